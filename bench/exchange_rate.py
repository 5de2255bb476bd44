"""Benchmark: the rate at which a real training run's exchange moves its bytes, against raw TCP.

    python bench/exchange_rate.py [--config configs/default.toml] [--steps 40] [--rounds 2]
                                  [--set KEY=VALUE ...]

Issue 20 asks that in a real 2-pod run of the default config, a pod's exchange time less its idle
wait (the time it waited for peers' chunks) moves its bytes at at least 0.8 of raw TCP's rate.
Each round, in one window:
  1. raw TCP between two processes, both directions at once, with the run's per-pod bytes per
     step (bench/dcn.py's raw_tcp contender, --payload-bytes);
  2. `multipod local --pods 2` on the config as a user runs it (its default dcn settings), with
     the closing sample and evaluation off; per pod and step after the first three (compile and
     warm-up): dcn_bytes_sent / (exchange_s - idle_s), from metrics.jsonl.
Medians per round and overall; the ratio is the run's rate over raw TCP's. Prints one JSON object.
The exchange here shares two cores with both pods' compute, which raw TCP alone does not.

With dcn.overlap (the default where the layout allows it) the exchange starts with the backward
pass and waits on the pod's own leaves as much as on its peers': exchange_s - idle_s is then mostly
the backward pass, not the transfer (measured: 12 MB/s, 0.016 of raw TCP, with 15 ms exposed). The
rate means something for the fused step: `--set dcn.overlap=false`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = 3                 # the first steps compile and warm up
RUN_TIMEOUT_S = 900.0


def _raw_tcp(payload: int, repeats: int) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "dcn.py"), "--variants", "transport", "--skip-gloo",
           "--payload-bytes", str(payload), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"bench/dcn.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    return {"raw_tcp": result["raw_tcp"], "transport": result["multipod"]["transport"]}


def _run(config: str, steps: int, settings: list[str], run_dir: pathlib.Path) -> list[dict]:
    cmd = [sys.executable, "-m", "multipod.cli", "local", "--pods", "2", "--config", config, "--steps", str(steps),
           "--no-peak", "--set", "sample.tokens=0", "--set", "eval.batches=0", "--run-dir", str(run_dir)]
    for setting in settings:
        cmd += ["--set", setting]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"multipod local failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def _rates(records: list[dict]) -> tuple[list[float], int, dict]:
    """Per pod and step: bytes over (exchange - idle); the bytes per pod per step; the medians of
    the parts, for the record."""
    rates, sizes, parts = [], [], {"exchange_s": [], "idle_s": [], "exposed_exchange_s": [], "compute_s": []}
    for record in records[SKIP:]:
        for pod in record["pods"]:
            moving = pod["exchange_s"] - pod["idle_s"]
            if moving > 0 and pod["dcn_bytes_sent"] > 0:
                rates.append(pod["dcn_bytes_sent"] / moving / 1e6)
                sizes.append(pod["dcn_bytes_sent"])
            for key in parts:
                parts[key].append(pod[key])
    return rates, int(statistics.median(sizes)), {k: round(statistics.median(v), 5) for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="raw TCP transfers per round")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="multipod-exchange-rate-") as tmp:
        for index in range(args.rounds):
            records = _run(args.config, args.steps, args.set, pathlib.Path(tmp) / f"run{index}")
            rates, payload, parts = _rates(records)
            tcp = _raw_tcp(payload, args.repeats)
            run_rate = statistics.median(rates)
            rounds.append({"bytes_per_pod_step": payload, "run_MB_per_s": round(run_rate, 1),
                           "raw_tcp_MB_per_s": tcp["raw_tcp"].get("MB_per_s"),
                           "transport_MB_per_s": tcp["transport"].get("MB_per_s"),
                           "ratio_to_raw_tcp": round(run_rate / tcp["raw_tcp"]["MB_per_s"], 3)
                           if tcp["raw_tcp"].get("MB_per_s") else None,
                           "median_parts_s": parts})
    ratios = [r["ratio_to_raw_tcp"] for r in rounds if r["ratio_to_raw_tcp"] is not None]
    print(json.dumps({"benchmark": "exchange_rate", "config": args.config, "steps": args.steps,
                      "settings": args.set, "machine": f"{os.cpu_count()} cores",
                      "load_average_after": os.getloadavg(), "rounds": rounds,
                      "median_ratio_to_raw_tcp": statistics.median(ratios) if ratios else None,
                      "target": 0.8}, indent=2))


if __name__ == "__main__":
    main()
