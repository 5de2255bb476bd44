"""Benchmark: DiLoCo (issue 22) against every-step sync: quality, bandwidth, time to a loss on a slow
link, and the exposed part of the outer exchanges.

    python -m bench.diloco [--quick] [--only quality,bandwidth,slow] [--keep-dir DIR]
                           [--config configs/bench.toml] [--set KEY=VALUE ...]

Every run is one `multipod local --devices-per-pod 1` (simulated pods on this machine) in a
temporary directory, with --checkpoint-every 0, no sample, no peak measurement. DiLoCo runs use
sync.outer_dtype = int4 and the outer Nesterov step at the papers' lr 0.7 and momentum 0.9 (the
defaults). F (sync.fragments) for a given H is the largest of 1..min(4, model.n_layers) that
divides H and leaves sync.overlap_steps below H/F (H=10: 2, H=20: 4, H=25: 1, H=50: 2 on the
4-layer bench model). Every figure comes from the runs' own metrics.jsonl:

1. Quality: --pods (4) pods, --steps (600) steps, eval every --eval-every (50) steps on
   --eval-batches (16) held-out batches (the same batches at every point and in every run: the
   differences between runs are paired). Every-step sync (float32, the default), then DiLoCo at
   each H of --h-values (10, 20, 50) with --overlap-steps (1). Reported: every run's eval loss at
   each eval point, and each DiLoCo run's relative difference (diloco - every_step) / every_step
   at each point and at the end. The tokens per step are the same in every run (the global
   batch), so equal steps are equal tokens. Target: |final relative difference| <= 3% at H=20,
   F=4, int4.
2. Bandwidth: DCN bytes per step = the sum of dcn_bytes_sent (every pod's bytes) over the run /
   its steps. Every-step float32: the quality baseline above (without the quality part, a run of
   its own of --bandwidth-steps steps: its bytes are the same every step). DiLoCo: its own run at H=25, F=1,
   int4, overlap_steps=0 (so every sync started in the run is also applied and recorded in it),
   --pods pods, --bandwidth-steps (100, a multiple of 25) steps. The quality runs' bytes per step
   are reported too. Target: >= 100x fewer bytes per step.
3. Time to a loss on a slow link: --slow-pods (4) pods with dcn.link_gbps = --link-gbps (0.1, a
   100 Mb/s token bucket on each pod's sends). Every-step sync for --slow-steps (150) steps,
   evaluated every 25; its final eval loss is the target. Then DiLoCo at H=20, F=4, int4,
   overlap_steps --overlap-steps, evaluated every --slow-eval-every (10) steps and stopped (SIGINT)
   at the first eval whose loss is at or below the target, or at --slow-cap (2.5) x --slow-steps
   steps. Both runs use
   optimizer.decay_steps = --slow-steps, so their learning rates are the same step for step up to
   there (after it DiLoCo goes on at the schedule's floor, lr x min_lr_ratio). Time = the sum of
   step_time_s (the controller's time from one step's end to the next's) over steps 1..k-1 for
   the state after k steps: step 0 (the compile) is left out of both, evaluation time is not in
   step_time_s, and everything else is in, the outer programs' first compiles included.
   Target: DiLoCo's time to the target <= every-step's time / 3. Also reported: the two runs'
   median step time ratio, the bound on that speedup whatever DiLoCo's quality.
4. Overlap: the sum of outer_exposed_s (the slowest pod's wait for each outer exchange; all of the
   exchange's seconds when overlap_steps = 0) over the run's time as in 3, for the slow-link
   DiLoCo run above (overlap_steps --overlap-steps), for the same run with overlap_steps = 0
   (--overlap-compare-steps (100) steps), and for the loopback quality run at H=20. outer_exposed_s
   counts the wait on the exchange only: the pseudo-gradient and outer-update programs run on the
   inner steps' thread either way, so the runs' median inner step times and total times are
   reported beside it. Target: <= 1% with overlap.

The runs share one persistent compilation cache in the temporary directory
(JAX_COMPILATION_CACHE_DIR): a program is compiled by the first run that needs it and loaded by
the later ones, as in a long run; compiles fall in step 0 (left out of every time) and, for the
outer programs, in a DiLoCo run's first outer steps (counted).

Every run also reports whether the pods' checksums agreed at every step (every-step: the state;
DiLoCo: the agreed state), its median step time, the load average before and after it, and the
resident memory of its largest worker, sampled every 10 s (worker_rss_mb: DiLoCo workers grew
with every outer sync until the outer-step history was kept only after a pod's first save).

--only runs some of the parts (slow includes the overlap figures); --keep-dir keeps the runs'
directories (metrics, logs) instead of a deleted temporary directory. Prints one JSON object at
the end, also when a run fails (with "error" and the runs done so far); progress, and each run's
summary as it ends, go to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_DEADLINE_S = 3600.0
STOP_GRACE_S = 90.0


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _log(message: str) -> None:
    print(f"[bench.diloco {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _read(run_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) of a run's metrics.jsonl, a line still being written left out."""
    path = run_dir / "metrics.jsonl"
    steps, evals = [], []
    if not path.exists():
        return steps, evals
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            steps.append(record)
        elif "eval_loss" in record:
            evals.append(record)
    return steps, evals


def fragments_for(h: int, n_layers: int, overlap_steps: int) -> int:
    """The largest F <= min(4, n_layers) dividing H with overlap_steps < H / F."""
    return max(f for f in range(1, min(4, n_layers) + 1)
               if h % f == 0 and (overlap_steps == 0 or overlap_steps < h // f))


def diloco_settings(h: int, fragments: int, overlap_steps: int) -> list[str]:
    return ["sync.mode=diloco", f"sync.inner_steps={h}", f"sync.fragments={fragments}",
            f"sync.overlap_steps={overlap_steps}", "sync.outer_dtype=int4"]


def _worker_rss_mb(run_dir: pathlib.Path) -> list[float]:
    """The resident memory of each of the run's live workers (MB; their pids from worker-*.log)."""
    sizes = []
    for log in sorted(run_dir.glob("worker-*.log")):
        try:
            pid = re.findall(r"\(pid (\d+)\)", log.read_text())[-1]
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
        except (IndexError, OSError):
            continue
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        if match:
            sizes.append(int(match.group(1)) / 1024)
    return sizes


def run(args, tmp: pathlib.Path, name: str, pods: int, steps: int, settings: list[str],
        stop_below: float | None = None) -> dict:
    """One `multipod local` run; with stop_below, interrupted (SIGINT) at the first eval record whose
    loss is at or below it. Returns its summary (see summarise)."""
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "multipod.cli", "local", "--pods", str(pods), "--devices-per-pod", "1",
           "--config", args.config, "--steps", str(steps), "--run-dir", str(run_dir), "--checkpoint-every", "0",
           "--no-peak", "--set", "sample.tokens=0"]
    for kv in [*args.settings, *settings]:
        cmd += ["--set", kv]
    log_path = tmp / f"{name}.out"
    _log(f"{name}: {pods} pods, {steps} steps, {' '.join(settings)}")
    load_before, started = _load(), time.monotonic()
    stopped_at = None
    rss: list[tuple[int, float]] = []     # (steps recorded, the largest worker's RSS in MB)
    last_rss = 0.0
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp / "jax-cache")
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
        try:
            while proc.poll() is None:
                if time.monotonic() - started > RUN_DEADLINE_S:
                    raise RuntimeError(f"{name}: no end after {RUN_DEADLINE_S:.0f} s")
                if time.monotonic() - last_rss >= 10.0:
                    last_rss, sizes = time.monotonic(), _worker_rss_mb(run_dir)
                    if sizes:
                        rss.append((len(_read(run_dir)[0]), round(max(sizes))))
                if stop_below is not None and stopped_at is None:
                    reached = [e for e in _read(run_dir)[1] if e["eval_loss"] <= stop_below]
                    if reached:
                        stopped_at = reached[0]["trained_steps"]
                        proc.send_signal(signal.SIGINT)
                        try:
                            proc.wait(timeout=STOP_GRACE_S)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                        break
                time.sleep(0.5)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0 and stopped_at is None:
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        raise RuntimeError(f"{name} failed ({code}): {' '.join(cmd)}\n{tail}")
    out = summarise(run_dir, steps)
    out.update({"name": name, "pods": pods, "steps_asked": steps, "settings": settings, "exit_code": code,
                "stopped_at_eval": stopped_at, "wall_s": round(time.monotonic() - started, 1),
                "load_before": load_before, "load_after": _load(),
                "worker_rss_mb": {"max": max((m for _, m in rss), default=None),
                                  "samples": rss[::max(1, len(rss) // 12)]}})
    _log(f"{name}: done in {out['wall_s']} s, {out['steps']} steps, median step {out['median_step_s']:.3f} s, "
         f"final eval {out['final_eval_loss']}, largest worker RSS {out['worker_rss_mb']['max']} MB")
    _log(f"{name}: " + json.dumps(out))     # on stderr too, so that a later failure loses no run
    return out


def train_s(records: list[dict], trained: int) -> float:
    """Seconds to the state after `trained` steps: step_time_s of steps 1..trained-1 (step 0: the compile)."""
    return sum(r["step_time_s"] for r in records if 1 <= r["step"] < trained)


def summarise(run_dir: pathlib.Path, steps_asked: int) -> dict:
    records, evals = _read(run_dir)
    steps = [r["step"] for r in records]
    if steps != list(range(len(records))):
        raise RuntimeError(f"{run_dir.name}: steps not recorded once each in order: {steps[:5]}...")
    outer = [r for r in records if r.get("outer_sync") is not None]
    inner = [r["step_time_s"] for r in records[1:] if r.get("outer_sync") is None]
    total_bytes = sum(r["dcn_bytes_sent"] for r in records)
    run_s = train_s(records, len(records))
    exposed = sum(r.get("outer_exposed_s", 0.0) for r in records)
    return {
        "steps": len(records),
        "tokens_per_step": sorted({r["tokens"] for r in records}),
        "tokens": sum(r["tokens"] for r in records),
        "checksums_equal_every_step": all(len(set(r["checksums"])) == 1 for r in records),
        "median_step_s": statistics.median(r["step_time_s"] for r in records[1:]) if len(records) > 1 else None,
        "median_inner_step_s": statistics.median(inner) if inner else None,
        "train_s": round(run_s, 3),
        "evals": [{"trained_steps": e["trained_steps"], "eval_loss": round(e["eval_loss"], 5),
                   "train_s": round(train_s(records, e["trained_steps"]), 3)} for e in evals],
        "final_eval_loss": round(evals[-1]["eval_loss"], 5) if evals else None,
        "final_train_loss": round(records[-1]["loss"], 5) if records else None,
        "dcn_bytes_total": total_bytes,
        "dcn_bytes_per_step": total_bytes / len(records) if records else None,
        "outer_syncs": len(outer),
        "outer_bytes_per_sync": statistics.median(r["dcn_bytes_sent"] for r in outer) if outer else None,
        "outer_seconds_median": statistics.median(r["outer_seconds"] for r in outer) if outer else None,
        "outer_exposed_s_sum": round(exposed, 4),
        "outer_exposed_fraction": exposed / run_s if run_s else None,
    }


PARTS = ("quality", "bandwidth", "slow")


def quality_part(args, tmp: pathlib.Path, n_layers: int, out: dict) -> None:
    """1. Every-step sync against DiLoCo at each H of --h-values, at equal steps (= equal tokens)."""
    tau = args.overlap_steps
    evals = [f"eval.every={args.eval_every}", f"eval.batches={args.eval_batches}"]
    quality: dict = {"pods": args.pods, "steps": args.steps, "eval_every": args.eval_every,
                     "eval_batches": args.eval_batches, "overlap_steps": tau, "outer_dtype": "int4", "diloco": {}}
    out["quality"] = quality
    quality["every_step"] = every = run(args, tmp, "quality-every_step", args.pods, args.steps, evals)
    base = {e["trained_steps"]: e["eval_loss"] for e in every["evals"]}
    for h in [int(h) for h in args.h_values.split(",")]:
        f = fragments_for(h, n_layers, tau)
        result = run(args, tmp, f"quality-H{h}-F{f}", args.pods, args.steps, [*evals, *diloco_settings(h, f, tau)])
        result["H"], result["F"] = h, f
        result["relative_diff"] = {str(e["trained_steps"]): round((e["eval_loss"] - base[e["trained_steps"]])
                                                                  / base[e["trained_steps"]], 5)
                                   for e in result["evals"] if e["trained_steps"] in base}
        result["final_relative_diff"] = result["relative_diff"].get(str(args.steps))
        quality["diloco"][f"H={h}"] = result
    if "H=20" in quality["diloco"]:
        final = quality["diloco"]["H=20"]["final_relative_diff"]
        quality["target"] = "H=20, F=4, int4: final eval loss within 3% of every-step"
        quality["target_met"] = final is not None and abs(final) <= 0.03


def bandwidth_part(args, tmp: pathlib.Path, n_layers: int, out: dict) -> None:
    """2. DCN bytes per step: every-step float32 (the quality baseline, or a run of its own of
    --bandwidth-steps steps without the quality part) against DiLoCo H=25 int4."""
    every = out.get("quality", {}).get("every_step")
    if every is None:
        every = run(args, tmp, "bandwidth-every_step", args.pods, args.bandwidth_steps, ["eval.batches=0"])
    f25 = fragments_for(25, n_layers, 0)
    low = run(args, tmp, f"bandwidth-H25-F{f25}", args.pods, args.bandwidth_steps,
              ["eval.batches=0", *diloco_settings(25, f25, 0)])
    ratio = every["dcn_bytes_per_step"] / low["dcn_bytes_per_step"] if low["dcn_bytes_per_step"] else None
    out["bandwidth"] = {
        "every_step_float32_bytes_per_step": every["dcn_bytes_per_step"], "every_step_run": every["name"],
        "diloco_H25_int4_bytes_per_step": low["dcn_bytes_per_step"],
        "diloco_H25_F": f25, "diloco_H25_steps": low["steps"], "diloco_H25_outer_syncs": low["outer_syncs"],
        "diloco_H25_bytes_per_sync": low["outer_bytes_per_sync"],
        "ratio": ratio, "target": ">= 100x fewer bytes per step", "target_met": ratio is not None and ratio >= 100,
        "quality_runs_bytes_per_step": {k: v["dcn_bytes_per_step"]
                                        for k, v in out.get("quality", {}).get("diloco", {}).items()},
        "run": low if every["name"] != "bandwidth-every_step" else {"diloco": low, "every_step": every}}


def slow_part(args, tmp: pathlib.Path, n_layers: int, out: dict) -> None:
    """3. Time to a loss on a slow link, and 4. the exposed outer exchanges."""
    tau = args.overlap_steps
    link = [f"dcn.link_gbps={args.link_gbps}", f"optimizer.decay_steps={args.slow_steps}",
            f"eval.batches={args.eval_batches}"]
    cap = int(args.slow_steps * args.slow_cap)
    f20 = fragments_for(20, n_layers, tau)
    slow: dict = {"pods": args.slow_pods, "link_gbps": args.link_gbps, "every_step_steps": args.slow_steps,
                  "decay_steps": args.slow_steps, "diloco_cap_steps": cap, "H": 20, "F": f20, "diloco": {}}
    out["slow_link"] = slow
    slow["every_step"] = slow_every = run(args, tmp, "slow-every_step", args.slow_pods, args.slow_steps,
                                          [*link, f"eval.every={max(args.slow_eval_every, 25)}"])
    slow["target_eval_loss"] = target = slow_every["final_eval_loss"]
    slow["every_step_time_s"] = every_s = slow_every["train_s"]
    for overlap in dict.fromkeys((tau, 0)):
        name = f"slow-H20-F{f20}-overlap{overlap}"
        result = run(args, tmp, name, args.slow_pods, cap if overlap == tau else args.overlap_compare_steps,
                     [*link, f"eval.every={args.slow_eval_every}", *diloco_settings(20, f20, overlap)],
                     stop_below=target if overlap == tau else None)
        hit = next((e for e in result["evals"] if e["eval_loss"] <= target), None)
        result["reached_target_at_steps"] = hit["trained_steps"] if hit else None
        result["time_to_target_s"] = hit["train_s"] if hit else None
        result["speedup"] = every_s / hit["train_s"] if hit and hit["train_s"] else None
        slow["diloco"][f"overlap_steps={overlap}"] = result
    main_run, no_overlap = slow["diloco"][f"overlap_steps={tau}"], slow["diloco"]["overlap_steps=0"]
    slow.update({"diloco_time_to_target_s": main_run["time_to_target_s"],
                 "diloco_steps_to_target": main_run["reached_target_at_steps"], "speedup": main_run["speedup"],
                 "step_time_ratio": slow_every["median_step_s"] / main_run["median_step_s"],
                 "target": "DiLoCo reaches every-step's final eval loss >= 3x sooner",
                 "target_met": main_run["speedup"] is not None and main_run["speedup"] >= 3.0})
    fractions = {"slow_link_overlap": main_run["outer_exposed_fraction"],
                 "slow_link_no_overlap": no_overlap["outer_exposed_fraction"]}
    if "H=20" in out.get("quality", {}).get("diloco", {}):
        fractions["loopback_quality_H20_overlap"] = out["quality"]["diloco"]["H=20"]["outer_exposed_fraction"]
    out["overlap"] = {
        "overlap_steps": tau, "exposed_fraction_of_run": fractions,
        "exposed_s": {"slow_link_overlap": main_run["outer_exposed_s_sum"],
                      "slow_link_no_overlap": no_overlap["outer_exposed_s_sum"]},
        "run_s": {"slow_link_overlap": main_run["train_s"], "slow_link_no_overlap": no_overlap["train_s"]},
        "median_inner_step_s": {"slow_link_overlap": main_run["median_inner_step_s"],
                                "slow_link_no_overlap": no_overlap["median_inner_step_s"]},
        "target": "exposed outer exchange <= 1% of the run's time (with overlap)",
        "target_met": fractions["slow_link_overlap"] is not None and fractions["slow_link_overlap"] <= 0.01}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.diloco", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check of the script: 2 pods, runs of 10-40 steps, H=20 only")
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"the parts to run, comma-separated among {', '.join(PARTS)} (slow includes the "
                             f"overlap figures; default all)")
    parser.add_argument("--keep-dir", default=None,
                        help="keep the runs' directories here (default: a temporary directory, deleted)")
    parser.add_argument("--config", default="configs/bench.toml")
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--h-values", default="10,20,50")
    parser.add_argument("--overlap-steps", type=int, default=1)
    parser.add_argument("--bandwidth-steps", type=int, default=100)
    parser.add_argument("--slow-pods", type=int, default=4)
    parser.add_argument("--slow-steps", type=int, default=150)
    parser.add_argument("--slow-eval-every", type=int, default=10)
    parser.add_argument("--slow-cap", type=float, default=2.5)
    parser.add_argument("--overlap-compare-steps", type=int, default=100)
    parser.add_argument("--link-gbps", type=float, default=0.1)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.eval_batches, args.h_values = 20, 10, 4, "20"
        args.bandwidth_steps, args.slow_steps, args.slow_eval_every, args.slow_cap = 25, 20, 10, 2.0
        args.overlap_compare_steps, args.pods, args.slow_pods = 10, 2, 2
    parts = [p for p in args.only.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--only takes parts among {', '.join(PARTS)}, got {args.only!r}")
    with open(ROOT / args.config, "rb") as f:
        n_layers = tomllib.load(f).get("model", {}).get("n_layers", 4)
    for kv in args.settings:
        if kv.startswith("model.n_layers="):
            n_layers = int(kv.split("=", 1)[1])

    out: dict = {"command": "python -m bench.diloco " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "config": args.config,
                 "load_start": _load(), "uptime_start": _uptime()}
    started = time.monotonic()
    code = 0
    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp_name:
        tmp = pathlib.Path(args.keep_dir or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            for part, body in (("quality", quality_part), ("bandwidth", bandwidth_part), ("slow", slow_part)):
                if part in parts:
                    body(args, tmp, n_layers, out)
        except Exception as exc:    # noqa: BLE001 - the runs done so far are still printed
            out["error"] = f"{type(exc).__name__}: {exc}"
            code = 1
    out["load_end"], out["uptime_end"] = _load(), _uptime()
    out["bench_wall_s"] = round(time.monotonic() - started, 1)
    out["targets_met"] = {k: out[k]["target_met"] for k in ("quality", "bandwidth", "slow_link", "overlap")
                          if "target_met" in out.get(k, {})}
    print(json.dumps(out, indent=2))
    return code


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
