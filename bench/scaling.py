"""Benchmark: weak scaling as the PaLM paper measures it (one pod vs two pods, same per-pod batch).

    python bench/scaling.py                  # prints one JSON object

Run 1: one pod worker pinned to CPU core 0, per-pod batch B. Run 2: two pod workers, pinned to
cores 0 and 1, per-pod batch B each (global batch 2B). Same model, same seed; the controller is
left unpinned. Workers are started with `taskset` (or sched_setaffinity in a fresh interpreter),
never by forking a process that imported jax. The two configurations alternate for --rounds
rounds. Throughput is the median tokens/s over the steps after --warmup; the weak-scaling
efficiency is (2-pod throughput / 1-pod throughput) / 2. The per-step breakdown is the median of
each pod's compute, exchange, idle (waiting on the peer) and update time.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Small enough that its gradient (~13 MB) crosses the link quickly, with enough compute per step
# (>= 1 s on one core at the default batch) for the PaLM comparison.
MODEL = ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=64",
         "model.mlp_dim=1024", "model.max_seq_len=128"]


_TOKEN = secrets.token_hex(24)     # the workers and the controller share this run's secret


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MULTIPOD_AUTH_TOKEN=_TOKEN)
    env.pop("XLA_FLAGS", None)
    # One core per pod: keep XLA's and BLAS's thread pools to that core.
    env["OMP_NUM_THREADS"] = "1"
    return env


def _pinned(core: int, cmd: list[str]) -> list[str]:
    if shutil.which("taskset"):
        return ["taskset", "-c", str(core), *cmd]
    code = (f"import os, runpy, sys; os.sched_setaffinity(0, {{{core}}}); sys.argv = {cmd[2:]!r}; "
            f"runpy.run_module('multipod.cli', run_name='__main__')")
    return [sys.executable, "-c", code]


def start_workers(cores: list[int], folder: pathlib.Path) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    for pod, core in enumerate(cores):
        port_file = folder / f"pod{pod}.port"
        cmd = [sys.executable, "-m", "multipod.cli", "worker", "--pod-index", str(pod), "--listen", "127.0.0.1:0",
               "--devices", "1", "--port-file", str(port_file), "--exit-with-parent"]
        log = open(folder / f"worker-{pod}.log", "w")
        procs.append(subprocess.Popen(_pinned(core, cmd), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                      cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + 120
    for pod in range(len(cores)):
        port_file = folder / f"pod{pod}.port"
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or procs[pod].poll() is not None:
                log = (folder / f"worker-{pod}.log").read_text()[-2000:]
                raise SystemExit(f"pod {pod} did not start:\n{log}")
            time.sleep(0.05)
        addresses.append(f"127.0.0.1:{port_file.read_text().strip()}")
    return procs, addresses


def run(cores: list[int], batch: int, seq_len: int, steps: int, settings: list[str]) -> list[dict]:
    """Train `steps` steps on len(cores) pinned pods with per-pod batch `batch`; the metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        procs, addresses = start_workers(cores, folder)
        try:
            overrides = [*MODEL, f"data.seq_len={seq_len}", f"data.global_batch={batch * len(cores)}",
                         "optimizer.warmup_steps=2", "run.sample_tokens=0", "run.eval_batches=0",
                         "run.step_timeout_s=600", *settings]
            cmd = [sys.executable, "-m", "multipod.cli", "train", "--workers", ",".join(addresses),
                   "--steps", str(steps), "--seed", "1", "--run-dir", str(folder / "run"),
                   "--checkpoint-dir", str(folder / "checkpoints")]
            for o in overrides:
                cmd += ["--set", o]
            result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=3000)
            if result.returncode:
                raise SystemExit(f"training on {len(cores)} pod(s) failed:\n{result.stderr[-3000:]}")
            return [json.loads(l) for l in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def summarise(runs: list[list[dict]], warmup: int) -> dict:
    """Medians over the timed steps of every run of one configuration."""
    timed = [r for records in runs for r in records if r["step"] >= warmup]
    med = lambda xs: round(statistics.median(xs), 4)
    pods = len(timed[0]["pods"])
    per_pod = [{k: med([r["pods"][p][k] for r in timed]) for k in ("compute_s", "exchange_s", "idle_s",
                                                                    "update_s", "wait_s")}
               for p in range(pods)]
    step = med([r["step_time_s"] for r in timed])
    busy = statistics.mean(p["compute_s"] + p["update_s"] for p in per_pod)
    return {
        "steps_timed": len(timed),
        "tokens_per_step": timed[0]["tokens"],
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1),
        "per_run_median_tokens_per_s": [round(statistics.median(r["tokens_per_s"] for r in rec
                                                                if r["step"] >= warmup), 1) for rec in runs],
        "median_step_s": step,
        "per_pod": per_pod,
        # compute + update over the step time: the part of a step that one pod alone also spends.
        "busy_fraction": round(busy / step, 4),
        "dcn_bytes_sent_per_step": timed[0]["dcn_bytes_sent"],
        "loss_last": round(timed[-1]["loss"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="per-pod batch B (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="alternating 1-pod / 2-pod runs")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        help="extra config override for both runs, e.g. dcn.compression=\"bf16\"")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs at least 2 CPU cores (one per pod)")
    # One pod and two pods alternate, round by round, so that other load on the machine
    # affects both alike.
    ones, twos = [], []
    for _ in range(args.rounds):
        ones.append(run([0], args.batch, args.seq_len, args.steps, args.settings))
        twos.append(run([0, 1], args.batch, args.seq_len, args.steps, args.settings))
    one, two = summarise(ones, args.warmup), summarise(twos, args.warmup)
    ratio = two["median_tokens_per_s"] / one["median_tokens_per_s"]
    print(json.dumps({
        "benchmark": "scaling", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average": os.getloadavg(), "model": MODEL, "per_pod_batch": args.batch, "seq_len": args.seq_len,
        "settings": args.settings, "rounds": args.rounds, "one_pod": one, "two_pods": two,
        "throughput_ratio": round(ratio, 4), "weak_scaling_efficiency": round(ratio / 2, 4),
        # Less sensitive to load that changes between runs: the share of a 2-pod step spent on
        # the work one pod also does, relative to the same share in the 1-pod run.
        "busy_fraction_ratio": round(two["busy_fraction"] / one["busy_fraction"], 4),
    }, indent=2))


if __name__ == "__main__":
    main()
