"""Benchmark: hot-swap (issue 21): how long from a pod's kill until a spare trains in its slot.

    python -m bench.hot_swap [--configs configs/tiny.toml,configs/default.toml] [--rounds 2]

For each config, --rounds runs of `multipod local --pods 3 --spares 1 --devices-per-pod 1` with the
failure-detection settings of tests/e2e/test_failover.py (health.interval_s 0.5, timeout 2: a
dead pod is named after two missed checks). Once step --kill-step is recorded, pod 1 is killed
with SIGKILL (never restarted: a spare takes its slot). From the run's events.jsonl (Unix times on
this machine, as the kill's), the kill coming once the spare is ready (compiled on standby):

- detect_s: kill -> the pod_failure event (the watchdog, or a step failing on the dead peer);
- kill_to_training_s: kill -> the hot_swap event, written once the spare holds the state and the
  new membership, so the next step it computes is its slot's (what the target bounds);
- transfer_s: the state transfer to the spare (its `seconds`);
- swap_minus_transfer_s: kill_to_training_s - transfer_s, against the target of 2 s: detection,
  the spare's configure (its trainer compiled on standby), the steps in flight drained, and the
  wait for the next step boundary;
- lost_steps (summary.json) and whether the run's steps were each recorded once.

Medians over the rounds, with every round's values. Prints one JSON object.
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEALTH = ["--set", "health.interval_s=0.5", "--set", "health.timeout_s=2"]
DEADLINE_S = 900.0


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _records(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if "loss" in r]


def one_run(config: str, steps: int, kill_step: int, run_dir: pathlib.Path, extra: list[str]) -> dict:
    """One run with a kill; its timings from events.jsonl."""
    cmd = [sys.executable, "-m", "multipod.cli", "local", "--pods", "3", "--spares", "1", "--devices-per-pod", "1",
           "--config", config, "--steps", str(steps), "--run-dir", str(run_dir), "--checkpoint-every", "0",
           "--set", "sample.tokens=0", "--set", "eval.batches=0", "--set", "data.global_batch=6", "--no-peak",
           *HEALTH, *extra]
    with (run_dir.parent / f"{run_dir.name}.out").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + DEADLINE_S
        try:
            # A spare waits long before a failure in a real run: kill once it is ready (compiled).
            out_path = pathlib.Path(log.name)
            while not (any(r["step"] >= kill_step for r in _records(run_dir))
                       and "spare ready" in out_path.read_text()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no step {kill_step}: see {log.name}")
                time.sleep(0.02)
            pid = int(re.findall(r"\(pid (\d+)\)", (run_dir / "worker-1.log").read_text())[-1])
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
    if code != 0:
        raise RuntimeError(f"the run failed ({code}): see {log.name}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    failure = next(e for e in events if e["event"] == "pod_failure")
    swaps = [e for e in events if e["event"] == "hot_swap"]
    if not swaps:
        raise RuntimeError(f"the spare never took the slot (the run ended first?): see {log.name}")
    swap = swaps[0]
    records = _records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    kill_to_training = swap["time"] - killed_at
    return {"detect_s": failure["time"] - killed_at, "kill_to_training_s": kill_to_training,
            "transfer_s": swap["seconds"], "swap_minus_transfer_s": kill_to_training - swap["seconds"],
            "transfer_bytes": swap["bytes"], "swap_step": swap["step"], "lost_steps": summary["lost_steps"],
            "steps_recorded_once": [r["step"] for r in records] == list(range(steps)),
            "median_step_s": statistics.median(r["step_time_s"] for r in records if r["step_time_s"] > 0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_swap", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="configs/tiny.toml,configs/default.toml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    # Long enough that the spare trains well before the end, whatever the model's step time.
    steps = {"configs/tiny.toml": 400, "configs/default.toml": 150}
    out: dict = {"command": "python -m bench.hot_swap " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "load_start": _load(), "configs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-hot-swap-") as tmp:
        for config in args.configs.split(","):
            rounds = []
            for round_ in range(args.rounds):
                run_dir = pathlib.Path(tmp) / f"{pathlib.Path(config).stem}-{round_}"
                extra = [arg for kv in args.settings for arg in ("--set", kv)]
                rounds.append(one_run(config, steps.get(config, 100), args.kill_step, run_dir, extra))
            summary = {key: statistics.median(r[key] for r in rounds)
                       for key in ("detect_s", "kill_to_training_s", "transfer_s", "swap_minus_transfer_s",
                                   "median_step_s")}
            summary["target_met"] = summary["swap_minus_transfer_s"] <= 2.0
            out["configs"][config] = {"median": summary, "rounds": rounds}
    out["load_end"] = _load()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
