"""Benchmark: weak scaling as the PaLM paper measures it (one pod vs two pods, same per-pod batch).

    python bench/scaling.py                          # prints one JSON object
    python bench/scaling.py --hosts-per-pod 1,2      # 2 pods of K hosts each, for every K

Run 1: one pod worker pinned to CPU core 0, per-pod batch B. Run 2: two pod workers, pinned to
cores 0 and 1, per-pod batch B each (global batch 2B). Same model, same seed; the controller is
left unpinned. Workers are started with `taskset` (or sched_setaffinity in a fresh interpreter),
never by forking a process that imported jax. The two configurations alternate for --rounds
rounds. Throughput is the median tokens/s over the steps after --warmup; the weak-scaling
efficiency is (2-pod throughput / 1-pod throughput) / 2. The per-step breakdown is the median of
each pod's compute, exchange, idle (waiting on the peer) and update time.

With --hosts-per-pod K1,K2,... it measures pods of several hosts instead (issue 11): two pods,
each of the same --devices-per-pod devices (D) split over K worker processes (K hosts of D/K
devices each, one jax.distributed cluster per pod, started with the host flags that `multipod
local --hosts-per-pod K` gives its workers), per-pod batch B, for every K, alternating round by
round.
Every host of pod p is pinned to core p, so a pod has the same core whatever its K. Host h of
each pod exchanges block h of every gradient leaf with host h of the other pod, so each host
sends about 1/K of the gradient; a pod's record (and so `dcn_bytes_sent` and `exchange_s`) is
its host 0's. Per K: the median exchange_s over both pods' timed steps, the median step time, the
DCN bytes per host per step; and the ratios of each K to the first.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.procs import stop, wait_for_port  # noqa: E402

# Small enough that its gradient (~13 MB) crosses the link quickly, with enough compute per step
# (>= 1 s on one core at the default batch) for the PaLM comparison.
MODEL = ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=64",
         "model.mlp_dim=1024", "model.max_seq_len=128", 'data.tokenizer="bytes"']


_TOKEN = secrets.token_hex(24)     # the workers and the controller share this run's secret


def _env() -> dict:
    # The caller's PYTHONPATH stays first: e.g. a folder whose `multipod` is a checkout of one
    # commit, to measure that commit rather than the editable install's working tree.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", MULTIPOD_AUTH_TOKEN=_TOKEN)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(cores: list[int], folder: pathlib.Path, hosts_per_pod: int = 1,
                  devices_per_host: int = 1) -> tuple[list[subprocess.Popen], list[str]]:
    """One pod per core, each of `hosts_per_pod` worker processes (all pinned to the pod's core)
    with `devices_per_host` simulated devices each. Returns the processes and each pod's address
    as `--workers` takes it (its hosts' HOST:PORT joined with ",")."""
    procs, names = [], []
    multi = hosts_per_pod > 1
    for pod, core in enumerate(cores):
        coordinator = f"127.0.0.1:{_free_port()}"      # the pod's jax.distributed service (host 0)
        for host in range(hosts_per_pod):
            name = f"{pod}-host-{host}" if multi else f"{pod}"
            port_file = folder / f"pod{name}.port"
            cmd = [sys.executable, "-m", "multipod.cli", "worker", "--pod-index", str(pod), "--listen",
                   "127.0.0.1:0", "--devices", str(devices_per_host), "--port-file", str(port_file),
                   "--exit-with-parent"]
            if multi:
                cmd += ["--host-index", str(host), "--hosts-per-pod", str(hosts_per_pod),
                        "--pod-coordinator", coordinator]
            log = open(folder / f"worker-{name}.log", "w")
            procs.append(subprocess.Popen(_pinned(core, cmd), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                          cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True))
            names.append(name)
    deadline = time.monotonic() + 120
    ports = []
    for proc, name in zip(procs, names):
        address = wait_for_port(proc, folder / f"pod{name}.port", deadline)
        if address is None:
            log = (folder / f"worker-{name}.log").read_text()[-2000:]
            raise SystemExit(f"worker {name} did not start:\n{log}")
        ports.append(address)
    addresses = [",".join(ports[p * hosts_per_pod:(p + 1) * hosts_per_pod]) for p in range(len(cores))]
    return procs, addresses


def run(cores: list[int], batch: int, seq_len: int, steps: int, settings: list[str], hosts_per_pod: int = 1,
        devices_per_host: int = 1) -> list[dict]:
    """Train `steps` steps on len(cores) pinned pods with per-pod batch `batch`; the metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        procs, addresses = start_workers(cores, folder, hosts_per_pod, devices_per_host)
        try:
            overrides = [*MODEL, f"data.seq_len={seq_len}", f"data.global_batch={batch * len(cores)}",
                         "optimizer.warmup_steps=2", "sample.tokens=0", "eval.batches=0",
                         "run.step_timeout_s=600", *settings]
            workers = (";" if hosts_per_pod > 1 else ",").join(addresses)
            cmd = [sys.executable, "-m", "multipod.cli", "train", "--workers", workers,
                   "--steps", str(steps), "--seed", "1", "--run-dir", str(folder / "run"),
                   "--checkpoint-dir", str(folder / "checkpoints")]
            for o in overrides:
                cmd += ["--set", o]
            result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=3000)
            if result.returncode:
                raise SystemExit(f"training on {len(cores)} pod(s) of {hosts_per_pod} host(s) failed:\n"
                                 f"{result.stderr[-3000:]}")
            return [json.loads(l) for l in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        finally:
            stop(procs)


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


def summarise_hosts(runs: list[list[dict]], warmup: int) -> dict:
    """The exchange of pods of K hosts: medians over the timed steps of every run, both pods."""
    timed = [r for records in runs for r in records if r["step"] >= warmup]
    med = lambda xs: round(statistics.median(xs), 4)
    pods = [p for r in timed for p in r["pods"]]
    return {
        "steps_timed": len(timed),
        "median_exchange_s": med([p["exchange_s"] for p in pods]),       # both pods' (host 0's) records
        "median_exchange_s_per_pod": [med([r["pods"][i]["exchange_s"] for r in timed])
                                      for i in range(len(timed[0]["pods"]))],
        "median_exchange_time_s": med([r["exchange_time_s"] for r in timed]),   # the slower pod's, per step
        "median_idle_s": med([p["idle_s"] for p in pods]),
        "median_compute_s": med([p["compute_s"] for p in pods]),
        "median_update_s": med([p["update_s"] for p in pods]),
        "median_step_s": med([r["step_time_s"] for r in timed]),
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1),
        "per_run_median_exchange_s": [med([p["exchange_s"] for r in rec if r["step"] >= warmup for p in r["pods"]])
                                      for rec in runs],
        "per_run_median_step_s": [med([r["step_time_s"] for r in rec if r["step"] >= warmup]) for rec in runs],
        # A pod's record is its host 0's: the bytes one host put on the wire in one step.
        "dcn_bytes_per_host_per_step": int(statistics.median(p["dcn_bytes_sent"] for p in pods)),
        "loss_last": round(timed[-1]["loss"], 4),
    }


def main_hosts(args, counts: list[int], load_start) -> None:
    """2 pods of K hosts each, for every K in counts, with the same devices per pod."""
    for k in counts:
        if k < 1 or args.devices_per_pod % k:
            raise SystemExit(f"--hosts-per-pod {k}: --devices-per-pod {args.devices_per_pod} must split evenly "
                             f"over the hosts")
        if args.batch % k:
            raise SystemExit(f"--hosts-per-pod {k}: the per-pod batch {args.batch} must split over the hosts")
    results: dict[int, list] = {k: [] for k in counts}
    for _ in range(args.rounds):      # alternate, so that load on the machine hits every K alike
        for k in counts:
            results[k].append(run([0, 1], args.batch, args.seq_len, args.steps, args.settings, hosts_per_pod=k,
                                  devices_per_host=args.devices_per_pod // k))
    per_k = {k: summarise_hosts(results[k], args.warmup) for k in counts}
    base = per_k[counts[0]]
    ratios = {f"K={k}/K={counts[0]}": {
        key: round(per_k[k][key] / base[key], 4) if base[key] else None
        for key in ("median_exchange_s", "median_exchange_time_s", "median_step_s", "dcn_bytes_per_host_per_step",
                    "median_compute_s")} for k in counts[1:]}
    print(json.dumps({
        "benchmark": "scaling.hosts_per_pod", "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.system()}", "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "model": MODEL, "pods": 2, "devices_per_pod": args.devices_per_pod, "per_pod_batch": args.batch,
        "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "settings": args.settings,
        "rounds": args.rounds, "hosts_per_pod": {str(k): {"devices_per_host": args.devices_per_pod // k, **per_k[k]}
                                                 for k in counts},
        "ratios": ratios,
    }, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="per-pod batch B (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="alternating 1-pod / 2-pod runs")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        help="extra config override for both runs, e.g. dcn.compression=\"bf16\"")
    parser.add_argument("--hosts-per-pod", default="",
                        help="comma-separated host counts K, e.g. 1,2: instead of one pod vs two, run two pods of "
                             "K hosts each for every K (same --devices-per-pod), and compare their exchanges")
    parser.add_argument("--devices-per-pod", type=int, default=2,
                        help="with --hosts-per-pod: each pod's devices, split evenly over its K hosts")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs at least 2 CPU cores (one per pod)")
    load_start = os.getloadavg()
    if args.hosts_per_pod:
        try:
            counts = [int(k) for k in args.hosts_per_pod.split(",") if k.strip()]
        except ValueError:
            raise SystemExit(f"--hosts-per-pod takes comma-separated integers, got {args.hosts_per_pod!r}") from None
        if not counts:
            raise SystemExit("--hosts-per-pod: no host counts given")
        main_hosts(args, counts, load_start)
        return
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
        "load_average": os.getloadavg(), "load_average_start": load_start, "model": MODEL,
        "per_pod_batch": args.batch, "seq_len": args.seq_len,
        "settings": args.settings, "rounds": args.rounds, "one_pod": one, "two_pods": two,
        "throughput_ratio": round(ratio, 4), "weak_scaling_efficiency": round(ratio / 2, 4),
        # Less sensitive to load that changes between runs: the share of a 2-pod step spent on
        # the work one pod also does, relative to the same share in the 1-pod run.
        "busy_fraction_ratio": round(two["busy_fraction"] / one["busy_fraction"], 4),
    }, indent=2))


if __name__ == "__main__":
    main()
