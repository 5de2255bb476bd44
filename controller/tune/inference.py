"""`multipod tune --inference`: search one pod's layout for generation (mesh x generation batch).

The grid: every (data x model) mesh of the pod's devices whose model axis divides the sharded
dimensions (heads, MLP width, vocabulary), as for training (controller/tune/grid.py); explicitly
requested meshes (--meshes) are tried as given, so an impossible one comes back with its error.
With each mesh, the generation batches (--batches, default 1,2,4,8) that split evenly over its data
axis (the others are left out and listed: a pod would pad them with idle rows).

Every candidate is measured by the pod-side inference probe (pod_worker/inference_probe.py), a
child process with the pod's simulated device count, started and watched like the layout probe
(controller/tune/runner.py: one deadline per candidate, a crash or hang is charged to the
candidate that was running and the search goes on in a fresh probe). The probe generates --tokens
tokens after a --prompt-len prompt for every row of the batch with the pod's Generator on random
parameters, --steps times after a warm-up, and reports the time to the first token, the median
decode step (the per-token latency) and the whole generation's time; tokens/s is
batch x tokens / that time (prefill included: what a caller of `multipod generate` gets).

Ranking: the highest tokens/s among the rows within --max-latency-ms (ties: the lower per-token
latency). Rows over the limit are kept, marked and never best; then the rows over --memory-limit,
then the errors. The best layout is written as a config: the run's config with its [mesh], and
the [generate] section (devices, model axis, batch) that `multipod generate --layout` takes.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from multipod.controller.tune.grid import model_meshes, parse_int_list
from multipod.controller.tune.table import best_row

# Generation batches tried when --batches is not given (those the data axis splits evenly).
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_TOKENS = 32
DEFAULT_PROMPT_LEN = 16
PROBE_MODULE = "multipod.pod_worker.inference_probe"
STATUS_ORDER = {"ok": 0, "over latency limit": 1, "over memory limit": 2, "error": 3}
# Options of `multipod tune` that only one of the two modes uses: (attribute, flag, its default).
TRAINING_ONLY = (("microbatches", "--microbatches", None), ("remat", "--remat", None),
                 ("sequence_parallel", "--sequence-parallel", "both"), ("global_batch", "--global-batch", None),
                 ("pods", "--pods", 1), ("peak_flops", "--peak-flops", None))
INFERENCE_ONLY = (("batches", "--batches", None), ("tokens", "--tokens", None), ("prompt_len", "--prompt-len", None),
                  ("max_latency_ms", "--max-latency-ms", None))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `multipod tune --inference`."""
    parser.add_argument("--inference", action="store_true",
                        help="tune the layout for generation (mesh x batch, by latency and throughput) instead "
                             "of training")
    parser.add_argument("--batches", type=parse_int_list,
                        help="--inference: generation batch sizes to try, e.g. 1,4,8 (default 1,2,4,8; each must "
                             "split over the mesh's data axis)")
    parser.add_argument("--tokens", type=int,
                        help=f"--inference: tokens generated per prompt (default {DEFAULT_TOKENS}, at least 2)")
    parser.add_argument("--prompt-len", type=int,
                        help=f"--inference: prompt length in tokens (default {DEFAULT_PROMPT_LEN})")
    parser.add_argument("--max-latency-ms", type=float,
                        help="--inference: only layouts whose per-token latency (one decode step) is within this "
                             "many ms may be best")


def check_mode(args: argparse.Namespace) -> None:
    """ConfigError naming an option the chosen mode (training or --inference) does not use."""
    from multipod.controller.core.run_config import ConfigError
    if args.inference:
        for name, flag, default in TRAINING_ONLY:
            if getattr(args, name) != default:
                raise ConfigError(flag, "applies to training layouts, not to --inference")
    else:
        for name, flag, default in INFERENCE_ONLY:
            if getattr(args, name) != default:
                raise ConfigError(flag, "applies only with --inference")


@dataclasses.dataclass(frozen=True)
class InferenceCandidate:
    """One generation layout of a pod: its (data x model) mesh and the batch it generates for."""
    data: int
    model: int
    batch: int

    def label(self) -> str:
        """E.g. 'mesh 2x1 batch 4'."""
        return f"mesh {self.data}x{self.model} batch {self.batch}"


# -- the grid ----------------------------------------------------------------------------------
def enumerate_candidates(model_cfg, devices: int, meshes=None, batches=None
                         ) -> tuple[list[InferenceCandidate], list[str]]:
    """The grid of (mesh, batch) candidates, and one line per layout left out (and why).

    meshes, when given, are used as they are (an impossible one is reported by the probe); a batch
    the mesh's data axis does not divide is always left out (the pod would pad it with idle rows)."""
    skipped: list[str] = []
    if meshes is None:
        meshes, skipped = model_meshes(model_cfg, devices)
    candidates = []
    for data, model in meshes:
        for batch in batches or DEFAULT_BATCHES:
            if batch % data:
                skipped.append(f"mesh {data}x{model} batch {batch}: data={data} does not divide the batch of {batch}")
            else:
                candidates.append(InferenceCandidate(data, model, batch))
    return candidates, skipped


def candidate_config(base, candidate: InferenceCandidate):
    """The run config (controller.config.Config) with the candidate's mesh, and its layout as the
    [generate] section `multipod generate --layout` reads; not validated."""
    from multipod.controller.core.run_config import GenerateConfig
    from multipod.pod_worker.schema import MeshConfig
    layout = GenerateConfig(devices=candidate.data * candidate.model, model_parallel=candidate.model,
                            batch_size=candidate.batch)
    return dataclasses.replace(base, mesh=MeshConfig(data=candidate.data, model=candidate.model), generate=layout)


def candidate_payload(base, candidate: InferenceCandidate) -> dict:
    """What the inference probe gets for one candidate: the pod's WorkerConfig JSON and the batch."""
    return {"worker": candidate_config(base, candidate).worker_config().to_json(), "batch": candidate.batch}


# -- running the grid --------------------------------------------------------------------------
def row_summary(row: dict) -> str:
    """One line about a candidate's result, for the progress output (a row that did not run: as
    the training mode's)."""
    from multipod.controller.tune import runner as tune_runner
    from multipod.controller.tune.table import mib
    if row["status"] == "ok":
        return (f"first token {row['ttft_s'] * 1e3:.2f} ms, {row['token_latency_s'] * 1e3:.2f} ms/token, "
                f"{mib(row.get('memory_bytes'))} MiB")
    return tune_runner.row_summary(row)


def run_grid(config, candidates: list[InferenceCandidate], devices: int, prompt_len: int, tokens: int, steps: int,
             memory_limit: int | None, timeout_s: float, command: list[str] | None = None
             ) -> tuple[list[dict], dict]:
    """Measure every candidate in inference probes; one result per candidate, in grid order, and
    the probe's device info ({'device_kind', 'num_devices'}, empty if no probe ever started).
    command overrides the probe's command line (tests)."""
    from multipod.controller.tune.runner import run_candidates
    payloads = [candidate_payload(config, c) for c in candidates]
    spec = {"devices": devices, "prompt_len": prompt_len, "tokens": tokens, "steps": steps,
            "memory_limit": memory_limit}
    return run_candidates(candidates, payloads, spec, timeout_s, command or [sys.executable, "-m", PROBE_MODULE],
                          summary=row_summary)


# -- the ranking and the table -----------------------------------------------------------------
def rank(candidates: list[InferenceCandidate], results: list[dict], tokens: int,
         max_latency_ms: float | None) -> list[dict]:
    """Table rows: within the latency limit by tokens/s (highest first; ties: lower latency), then
    over the latency limit (same order), over the memory limit, errors. Ranks 1, 2, ... go to the
    rows within the limit only (they may be best)."""
    table = []
    for candidate, result in zip(candidates, results):
        row = {"mesh": f"{candidate.data}x{candidate.model}", **dataclasses.asdict(candidate), **result}
        row.setdefault("error", None)
        ttft, latency, total = row.get("ttft_s"), row.get("token_latency_s"), row.get("generate_s")
        row["ttft_ms"] = None if ttft is None else ttft * 1e3
        row["token_latency_ms"] = None if latency is None else latency * 1e3
        row["tokens_per_s"] = candidate.batch * tokens / total if total else None
        if row["status"] == "ok" and max_latency_ms is not None and row["token_latency_ms"] > max_latency_ms:
            row["status"] = "over latency limit"
        table.append(row)
    table.sort(key=lambda r: (STATUS_ORDER[r["status"]], -(r["tokens_per_s"] or 0.0),
                              r["token_latency_ms"] if r["token_latency_ms"] is not None else math.inf))
    for position, row in enumerate(table, 1):
        row["rank"] = position if row["status"] == "ok" else None
    return table


def print_table(table: list[dict], title: str, max_latency_ms: float | None = None) -> None:
    """The ranked table on stdout (rich), one line per candidate, errors in full."""
    from rich.console import Console
    from rich.table import Table

    from multipod.controller.tune.table import mib
    t = Table(title=title)
    for name in ("#", "mesh", "batch", "memory MiB", "first token ms", "ms/token", "tokens/s", "status"):
        t.add_column(name, justify="left" if name == "status" else "right")

    def ms(value):
        return "-" if value is None else f"{value:.2f}"

    for row in table:
        status = row["status"]
        if status == "error":
            status = f"error: {row['error']}"
        elif status == "over latency limit":
            status = f"over the latency limit ({max_latency_ms:g} ms)"
        t.add_row(str(row["rank"] or "-"), row["mesh"], str(row["batch"]), mib(row.get("memory_bytes")),
                  ms(row["ttft_ms"]), ms(row["token_latency_ms"]),
                  "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}", status)
    Console(width=200).print(t)


# -- the command -------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    """Run `multipod tune --inference`; the exit code: 0 when a best layout was written, 1 when no
    candidate ran within the limits (latency, memory) -- the table and --json are written anyway."""
    from multipod.controller.core.run_config import ConfigError, load_config
    from multipod.controller.observe.metrics import out
    from multipod.controller.tune.table import mib, write_config, write_report
    config = load_config(args.config, args.overrides)
    tokens = DEFAULT_TOKENS if args.tokens is None else args.tokens
    prompt_len = DEFAULT_PROMPT_LEN if args.prompt_len is None else args.prompt_len
    for name, value, least in (("--devices", args.devices, 1), ("--steps", args.steps, 1),
                               ("--tokens", tokens, 2), ("--prompt-len", prompt_len, 1)):
        if value < least:
            raise ConfigError(name, f"must be >= {least}, got {value}"
                              + (" (the per-token latency is a decode step after the first token)"
                                 if name == "--tokens" else ""))
    if prompt_len + tokens > config.model.max_seq_len:
        raise ConfigError("--tokens", f"--prompt-len {prompt_len} + --tokens {tokens} = {prompt_len + tokens} exceed "
                          f"the model's context (model.max_seq_len={config.model.max_seq_len})")
    if args.max_latency_ms is not None and not args.max_latency_ms > 0:
        raise ConfigError("--max-latency-ms", f"must be > 0 ms, got {args.max_latency_ms:g}")
    if not args.candidate_timeout > 0:
        raise ConfigError("--candidate-timeout", f"must be > 0 seconds, got {args.candidate_timeout:g}")
    candidates, skipped = enumerate_candidates(config.model, args.devices, args.meshes, args.batches)
    limits = [f"latency limit {args.max_latency_ms:g} ms/token"] if args.max_latency_ms is not None else []
    if args.memory_limit:
        limits.append(f"memory limit {args.memory_limit / 2**20:.1f} MiB per device")
    out(f"tuning a pod of {args.devices} device(s) for generation: {tokens} tokens after a {prompt_len}-token "
        f"prompt, {len(candidates)} candidate(s), {args.steps} timed generation(s) each"
        + "".join(f", {limit}" for limit in limits))
    for line in skipped:
        out(f"  left out {line}")
    if not candidates:
        raise ConfigError("--batches", "no candidate layouts to try")

    started = time.perf_counter()
    results, info = run_grid(config, candidates, args.devices, prompt_len, tokens, args.steps, args.memory_limit,
                             args.candidate_timeout)
    table = rank(candidates, results, tokens, args.max_latency_ms)
    print_table(table, f"multipod tune --inference: {len(candidates)} candidates, one pod of {args.devices} "
                       f"device(s), in {time.perf_counter() - started:.0f}s", args.max_latency_ms)
    out(f"first token: prefill of the batch's {prompt_len}-token prompts; ms/token: one decode step (a token for "
        f"every row); tokens/s: batch x {tokens} tokens / the whole generation (prefill included)")
    best = best_row(table)
    if args.json_path:
        write_report(args.json_path, table, mode="inference", devices=args.devices, prompt_len=prompt_len,
                     tokens=tokens, steps=args.steps, max_latency_ms=args.max_latency_ms,
                     memory_limit=args.memory_limit, device_kind=info.get("device_kind"), skipped=skipped)
        out(f"table written to {args.json_path}")
    if best is None:
        over = [r for r in table if r["status"] == "over latency limit"]
        if over:
            fastest = min(over, key=lambda r: r["token_latency_ms"])
            out(f"no candidate is within --max-latency-ms {args.max_latency_ms:g}: the lowest per-token latency "
                f"measured was {fastest['token_latency_ms']:.2f} ms (mesh {fastest['mesh']} batch "
                f"{fastest['batch']}); no config written")
        else:
            out("no candidate ran within the limits: no config written")
        return 1
    choice = InferenceCandidate(best["data"], best["model"], best["batch"])
    header = [f"written by `multipod tune --inference`: the highest throughput of {len(candidates)} generation "
              f"layouts for one pod of {args.devices} device(s)"
              + (f" within {args.max_latency_ms:g} ms/token" if args.max_latency_ms is not None else ""),
              f"{choice.label()}: first token {best['ttft_ms']:.2f} ms, {best['token_latency_ms']:.2f} ms/token, "
              f"{best['tokens_per_s']:,.0f} tokens/s ({tokens} tokens after {prompt_len}), "
              f"{mib(best.get('memory_bytes'))} MiB per device",
              f"use it with `multipod generate --checkpoint DIR --layout {args.out}` (its [generate] section)"]
    write_config(args.out, candidate_config(config, choice), header)
    out(f"best: {choice.label()} -> {args.out} (generate with `multipod generate --checkpoint DIR --layout "
        f"{args.out}`)")
    return 0
