"""`multipod tune`: search one pod's layout (mesh, sequence parallelism, microbatches, remat).

The grid: every (data x model) mesh of the pod's devices whose model axis divides the sharded
dimensions (heads, MLP width, vocabulary); sequence parallelism on and off (on only where the
model axis is > 1: with one model shard it is the same program); the microbatch counts that split
each data shard evenly; the three remat policies. Explicitly requested values (--meshes,
--microbatches, ...) are tried as given, so an impossible one is reported with its error.

Every candidate is compiled once, in a child process that has the pod's simulated device count
(it must be set before jax initialises). Candidates whose compiled per-device memory exceeds
--memory-limit are reported and not timed; the others run a few steps (the pod's real step:
forward/backward, gradient to host, update) and report the median. A candidate that fails to
compile or run -- or crashes or hangs the child -- is reported with its error and the search goes
on in a fresh child. Across pods the DCN axis is always data-parallel, so tuning one pod's layout
is tuning the run's: every pod uses the same layout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import queue
import re
import statistics
import subprocess
import sys
import threading
import time

DCN_NOTE = ("Tuning one pod's layout: across pods the DCN axis is always data-parallel, so every pod "
            "uses this layout and the global batch is split evenly over the pods.")
REMATS = ("none", "full", "selective")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout of a pod."""
    data: int
    model: int
    sequence_parallel: bool
    microbatches: int
    remat: str

    def label(self) -> str:
        return (f"mesh {self.data}x{self.model} sp={'on' if self.sequence_parallel else 'off'} "
                f"microbatches={self.microbatches} remat={self.remat}")


# -- arguments ---------------------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1.5GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _remat_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in REMATS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"remat policies are {', '.join(REMATS)}; got {text!r}")
    return values


def _mesh_list(text: str) -> list[tuple[int, int]]:
    meshes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise argparse.ArgumentTypeError(f"meshes look like DATAxMODEL, e.g. 2x2,4x1; got {part!r}")
        meshes.append((int(match.group(1)), int(match.group(2))))
    return meshes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `multipod tune`."""
    parser.add_argument("--config", help="TOML config file with the model to tune (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--devices", type=int, default=2, help="devices in one pod (simulated on CPU; default 2)")
    parser.add_argument("--pods", type=int, default=1,
                        help="pods the global batch is split over (default 1); each pod gets global_batch/pods")
    parser.add_argument("--global-batch", type=int, help="sequences per step over all pods (data.global_batch)")
    parser.add_argument("--memory-limit", type=parse_bytes,
                        help="drop candidates whose compiled per-device memory exceeds this (e.g. 2GiB)")
    parser.add_argument("--meshes", type=_mesh_list, help="only these DATAxMODEL meshes, e.g. 2x2,4x1")
    parser.add_argument("--microbatches", type=_int_list, help="only these microbatch counts, e.g. 1,2,4")
    parser.add_argument("--remat", type=_remat_list, help=f"only these remat policies ({','.join(REMATS)})")
    parser.add_argument("--sequence-parallel", choices=("both", "on", "off"), default="both",
                        help="try sequence parallelism on, off, or both (default both)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per candidate (median; default 5)")
    parser.add_argument("--candidate-timeout", type=float, default=600.0,
                        help="seconds one candidate may take to compile and run (default 600)")
    parser.add_argument("--peak-flops", type=float,
                        help="peak FLOP/s of one device for MFU/HFU (default: the stored `multipod "
                             "peak-flops` measurement, else measured now)")
    parser.add_argument("--out", default="tuned.toml", help="where to write the best candidate's config (default tuned.toml)")
    parser.add_argument("--json", dest="json_path", help="also write the ranked table as JSON here")


# -- the grid ----------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(model_cfg, per_pod_batch: int, devices: int, meshes=None, microbatches=None,
                         remats=None, sequence_parallel: str = "both") -> tuple[list[Candidate], list[str]]:
    """The grid of candidates, and one line per layout the heuristic left out (and why)."""
    skipped = []
    if meshes is None:
        meshes = []
        for model in _divisors(devices):
            bad = [f"{name}={getattr(model_cfg, name)}" for name in ("n_heads", "mlp_dim", "vocab_size")
                   if getattr(model_cfg, name) % model]
            if bad:
                skipped.append(f"mesh {devices // model}x{model}: model={model} does not divide {', '.join(bad)}")
            elif per_pod_batch % (devices // model):
                skipped.append(f"mesh {devices // model}x{model}: data={devices // model} does not divide "
                               f"the pod's batch of {per_pod_batch}")
            else:
                meshes.append((devices // model, model))
    remats = list(remats or REMATS)
    candidates = []
    for data, model in meshes:
        if microbatches is None:
            rows = per_pod_batch // data if per_pod_batch % data == 0 else 0
            counts = [k for k in (1, 2, 4, 8) if rows and rows % k == 0]
        else:
            counts = list(microbatches)
        sp_values = {"both": (False, True), "on": (True,), "off": (False,)}[sequence_parallel]
        if model == 1 and sequence_parallel == "both":
            sp_values = (False,)  # one model shard: sequence parallelism is the same program
        for sp in sp_values:
            for k in counts:
                for remat in remats:
                    candidates.append(Candidate(data, model, sp, k, remat))
    return candidates, skipped


def candidate_config(base, candidate: Candidate):
    """The run config with a candidate's layout applied."""
    from multipod.controller.config import MeshConfig
    model = dataclasses.replace(base.model, sequence_parallel=candidate.sequence_parallel,
                                microbatches=candidate.microbatches, remat=candidate.remat)
    return dataclasses.replace(base, model=model, mesh=MeshConfig(data=candidate.data, model=candidate.model))


# -- TOML output -------------------------------------------------------------------------------
def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def config_toml(config, header: list[str]) -> str:
    """The whole config as TOML that `--config` accepts (every section, every key)."""
    lines = [f"# {line}" for line in header]
    for section, values in config.to_dict().items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


# -- the child: compile and time candidates on the pod's devices -------------------------------
def _child_main() -> int:
    spec = json.loads(sys.stdin.readline())
    from multipod.pod_worker.devices import simulate_cpu_devices
    if spec["devices"]:
        simulate_cpu_devices(spec["devices"])

    import jax
    import numpy as np

    from multipod.controller.config import Config
    from multipod.pod_worker import programs
    from multipod.pod_worker.trainer import PodTrainer

    def emit(**fields):
        print(json.dumps(fields), flush=True)

    base = Config.from_json(spec["config"])
    rows, seq = spec["per_pod_batch"], base.data.seq_len
    global_tokens = spec["global_batch"] * seq
    emit(event="ready", device_kind=jax.devices()[0].device_kind, num_devices=len(jax.devices()))
    tokens = np.random.RandomState(0).randint(0, base.model.vocab_size, size=(rows, seq + 1)).astype(np.int32)
    for index, fields in spec["candidates"]:
        candidate = Candidate(**fields)
        emit(event="start", index=index)
        result = {"index": index}
        try:
            config = candidate_config(base, candidate).validate()
            programs.check_microbatches(rows, candidate.microbatches)  # fail before building anything
            start = time.perf_counter()
            trainer = PodTrainer(config.worker_config(), devices=jax.devices()[:spec["devices"] or None])
            trainer.compile_for(tokens.shape)
            result["compile_s"] = time.perf_counter() - start
            stats = trainer.compiled_stats()
            result.update(stats)
            peaks = [b for b in (stats["peak_bytes"], stats["update_peak_bytes"]) if b is not None]
            result["memory_bytes"] = max(peaks) if peaks else None
            limit = spec["memory_limit"]
            if limit and result["memory_bytes"] is not None and result["memory_bytes"] > limit:
                result["status"] = "over memory limit"
            else:
                batch = trainer.put_batch(tokens)
                times = []
                for step in range(spec["steps"] + 1):  # the first run is warm-up, not timed
                    t0 = time.perf_counter()
                    leaves, _, _ = trainer.gradients(batch, global_tokens)
                    trainer.apply(leaves)  # returns host floats: the step is finished
                    if step:
                        times.append(time.perf_counter() - t0)
                result["step_times_s"] = times
                result["step_time_s"] = statistics.median(times)
                result["status"] = "ok"
            del trainer
        except Exception as exc:  # noqa: BLE001 -- every failure is a row of the table
            result["status"] = "error"
            result["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        emit(event="result", **result)
    emit(event="done")
    return 0


class _Child:
    """One child process evaluating candidates; its stdout lines arrive on a queue."""

    def __init__(self, spec: dict):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # the child sets the pod's device count itself
        self.proc = subprocess.Popen([sys.executable, "-m", "multipod.controller.tune", "--child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.close()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                continue  # stray output from a library
        self.lines.put(None)

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-40]

    def next(self, timeout_s: float):
        """The next message, None when the child exited, or raises queue.Empty on timeout."""
        return self.lines.get(timeout=timeout_s)

    def tail(self) -> str:
        lines = [l.rstrip() for l in self.stderr if l.strip() and "Warning" not in l]
        return " | ".join(lines[-3:])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


# -- the parent: run the grid, rank, report ----------------------------------------------------
class _Progress:
    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.console = Console(stderr=True)
        self.total = total
        self.progress = None
        if self.console.is_terminal:
            self.progress = Progress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=self.console)
            self.task = self.progress.add_task("tune", total=total, what="starting")
            self.progress.start()

    def start(self, done: int, candidate: Candidate):
        if self.progress is not None:
            self.progress.update(self.task, completed=done, what=f"compiling + timing {candidate.label()}")
        else:
            print(f"[{done + 1}/{self.total}] {candidate.label()} ...", file=sys.stderr, flush=True)

    def finish(self, done: int, candidate: Candidate, row: dict):
        summary = _row_summary(row)
        if self.progress is not None:
            self.progress.update(self.task, completed=done)
            self.progress.console.print(f"  {candidate.label()}: {summary}")
        else:
            print(f"[{done}/{self.total}] {candidate.label()}: {summary}", file=sys.stderr, flush=True)

    def close(self):
        if self.progress is not None:
            self.progress.stop()


def _row_summary(row: dict) -> str:
    if row["status"] == "ok":
        return f"{row['step_time_s'] * 1e3:.1f} ms/step, {_mib(row.get('memory_bytes'))} MiB"
    if row["status"] == "over memory limit":
        return f"over the memory limit ({_mib(row.get('memory_bytes'))} MiB)"
    return f"error: {row['error'][:200]}"


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:.2f}"


def run_grid(config, candidates: list[Candidate], devices: int, per_pod_batch: int, steps: int,
             memory_limit: int | None, timeout_s: float) -> tuple[list[dict], dict]:
    """Evaluate every candidate (in child processes); one row per candidate, in grid order."""
    rows: dict[int, dict] = {}
    info: dict = {}
    progress = _Progress(len(candidates))
    pending = list(enumerate(candidates))
    try:
        while pending:
            spec = {"config": config.to_json(), "devices": devices, "per_pod_batch": per_pod_batch,
                    "global_batch": config.data.global_batch, "steps": steps, "memory_limit": memory_limit,
                    "candidates": [(i, dataclasses.asdict(c)) for i, c in pending]}
            child = _Child(spec)
            current = None
            try:
                while True:
                    try:
                        # Starting jax in the child takes a while too; the same deadline covers it.
                        message = child.next(timeout_s)
                    except queue.Empty:
                        what = "starting the tuning process" if current is None else "this candidate"
                        error = f"timed out: {what} took more than {timeout_s:g}s"
                        break
                    if message is None:
                        child.proc.wait(timeout=30)
                        error = (f"the tuning process died (exit code {child.proc.returncode})"
                                 + (f": {child.tail()}" if child.tail() else ""))
                        break
                    event = message.pop("event")
                    if event == "ready":
                        info = message
                    elif event == "start":
                        current = message["index"]
                        progress.start(len(rows), candidates[current])
                    elif event == "result":
                        index = message.pop("index")
                        rows[index] = message
                        progress.finish(len(rows), candidates[index], message)
                        current = None
                    elif event == "done":
                        error = None
                        break
            finally:
                child.kill()
            if error is not None:
                # Charge the failure to the candidate that was running (or the first one left), then
                # go on with the rest in a fresh process.
                victim = current if current is not None else next(i for i, _ in pending if i not in rows)
                rows[victim] = {"status": "error", "error": error}
                progress.finish(len(rows), candidates[victim], rows[victim])
            pending = [(i, c) for i, c in pending if i not in rows]
    finally:
        progress.close()
    return [rows[i] for i in range(len(candidates))], info


def rank(candidates: list[Candidate], results: list[dict], model_flops_per_step: float, tokens_per_step: int,
         peak: float | None, devices: int) -> list[dict]:
    """Table rows: the candidates that ran, fastest first, then over-limit ones, then errors."""
    table = []
    for candidate, result in zip(candidates, results):
        row = {"mesh": f"{candidate.data}x{candidate.model}", **dataclasses.asdict(candidate), **result}
        row.setdefault("error", None)
        step = row.get("step_time_s")
        hw = row.get("hardware_flops_per_step")
        row["tokens_per_s"] = tokens_per_step / step if step else None
        row["model_flops_per_step"] = model_flops_per_step
        denominator = peak * devices if peak else None
        row["mfu"] = model_flops_per_step / step / denominator if step and denominator else None
        row["hfu"] = hw / step / denominator if step and denominator and hw else None
        table.append(row)
    order = {"ok": 0, "over memory limit": 1, "error": 2}
    table.sort(key=lambda r: (order[r["status"]], r.get("step_time_s") or math.inf, r.get("memory_bytes") or 0))
    for position, row in enumerate(table, 1):
        row["rank"] = position if row["status"] == "ok" else None
    return table


def print_table(table: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for name in ("#", "mesh", "sp", "micro", "remat", "memory MiB", "step ms", "tokens/s", "MFU", "HFU", "status"):
        t.add_column(name, justify="right" if name not in ("remat", "status") else "left")
    pct = lambda v: "n/a" if v is None else f"{v:.1%}"
    for row in table:
        t.add_row(str(row["rank"] or "-"), row["mesh"], "on" if row["sequence_parallel"] else "off",
                  str(row["microbatches"]), row["remat"], _mib(row.get("memory_bytes")),
                  "-" if row.get("step_time_s") is None else f"{row['step_time_s'] * 1e3:.1f}",
                  "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}",
                  pct(row["mfu"]), pct(row["hfu"]),
                  row["status"] if row["status"] != "error" else f"error: {row['error']}")
    Console(width=200).print(t)


def main(args: argparse.Namespace) -> int:
    """Run `multipod tune`; returns the exit code (0: a best candidate was written)."""
    from multipod.controller.config import ConfigError, load_config
    from multipod.controller.metrics import load_measured_peak, out
    overrides = list(args.overrides)
    if args.global_batch is not None:
        overrides.append(f"data.global_batch={args.global_batch}")
    config = load_config(args.config, overrides)
    if args.devices < 1:
        raise ConfigError("--devices", f"must be >= 1, got {args.devices}")
    if args.pods < 1:
        raise ConfigError("--pods", f"must be >= 1, got {args.pods}")
    if args.steps < 1:
        raise ConfigError("--steps", f"must be >= 1, got {args.steps}")
    if config.data.global_batch % args.pods:
        raise ConfigError("data.global_batch", f"{config.data.global_batch} does not split over {args.pods} pods")
    per_pod = config.data.global_batch // args.pods
    candidates, skipped = enumerate_candidates(config.model, per_pod, args.devices, args.meshes, args.microbatches,
                                               args.remat, args.sequence_parallel)
    out(DCN_NOTE)
    out(f"tuning a pod of {args.devices} device(s) for a batch of {per_pod} sequences x {config.data.seq_len} "
        f"tokens ({config.data.global_batch} over {args.pods} pod(s)): {len(candidates)} candidate(s), "
        f"{args.steps} timed step(s) each" + (f", memory limit {args.memory_limit / 2**20:.1f} MiB per device"
                                               if args.memory_limit else ""))
    for line in skipped:
        out(f"  left out {line}")
    if not candidates:
        raise ConfigError("--meshes", "no candidate layouts to try")

    peak = args.peak_flops
    started = time.perf_counter()
    results, info = run_grid(config, candidates, args.devices, per_pod, args.steps, args.memory_limit,
                             args.candidate_timeout)
    if peak is None and info:
        peak = load_measured_peak(info["device_kind"], args.devices)
        if peak is None:
            from multipod.controller.peak import measure
            out("measuring the devices' peak FLOP/s for MFU/HFU (store one with `multipod peak-flops`)")
            peak = measure(args.devices)["per_device_flops"]
    tokens_per_step = per_pod * config.data.seq_len
    model_flops = config.model.flops_per_token(config.data.seq_len) * tokens_per_step
    table = rank(candidates, results, model_flops, tokens_per_step, peak, args.devices)
    elapsed = time.perf_counter() - started
    print_table(table, f"multipod tune: {len(candidates)} candidates for one pod of {args.devices} device(s) "
                       f"in {elapsed:.0f}s (peak {peak / 1e9:.1f} GFLOP/s per device)" if peak else
                       f"multipod tune: {len(candidates)} candidates in {elapsed:.0f}s")
    out(DCN_NOTE)
    best = next((row for row in table if row["status"] == "ok"), None)
    if args.json_path:
        report = {"devices": args.devices, "pods": args.pods, "per_pod_batch": per_pod,
                  "seq_len": config.data.seq_len, "memory_limit": args.memory_limit, "peak_flops": peak,
                  "device_kind": info.get("device_kind"), "note": DCN_NOTE, "skipped": skipped,
                  "best": None if best is None else best["rank"], "rows": table}
        pathlib.Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        out(f"table written to {args.json_path}")
    if best is None:
        out("no candidate ran within the limits: no config written")
        return 1
    choice = Candidate(best["data"], best["model"], best["sequence_parallel"], best["microbatches"], best["remat"])
    header = [f"written by `multipod tune`: the fastest of {len(candidates)} candidates for one pod of "
              f"{args.devices} device(s)", f"{choice.label()}: {best['step_time_s'] * 1e3:.1f} ms/step, "
              f"{_mib(best.get('memory_bytes'))} MiB per device", DCN_NOTE]
    pathlib.Path(args.out).write_text(config_toml(candidate_config(config, choice), header))
    out(f"best: {choice.label()} -> {args.out} (train with `multipod local --pods {args.pods} "
        f"--devices-per-pod {args.devices} --config {args.out}`)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(_child_main())
    sys.exit("usage: multipod tune ... (this module's --child mode is internal)")
