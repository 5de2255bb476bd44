"""Benchmark: weak scaling as the PaLM paper measures it (one pod vs two pods, same per-pod batch).

    python bench/scaling.py                          # prints one JSON object
    python bench/scaling.py --variants default,fused # the config's default step, and the fused one
    python bench/scaling.py --netns --link-fraction 0.3   # pods in namespaces, link shaped to 30%
    python bench/scaling.py --hosts-per-pod 1,2      # 2 pods of K hosts each, for every K

Run 1: one pod worker pinned to CPU core 0, per-pod batch B. Run 2: two pod workers, pinned to
cores 0 and 1, per-pod batch B each (global batch 2B). Same model, same seed; the controller is
left unpinned. Workers are started with `taskset` (or sched_setaffinity in a fresh interpreter),
never by forking a process that imported jax. The two configurations alternate for --rounds
rounds. Throughput is the median tokens/s over the steps after --warmup; the weak-scaling
efficiency is (2-pod throughput / 1-pod throughput) / 2. The per-step breakdown is the median of
each pod's compute, exchange, idle (waiting on the peer) and update time.

What the orchestration controls is reported apart from the compute (issue 20): a step's busy
fraction is its slowest pod's compute_s (forward + backward) over the step time; the part of the
step beyond it is exposed exchange, idle, update and dispatch. busy_fraction_ratio = the 2-pod
busy fraction / the 1-pod one (1.0: two pods add nothing beyond their compute);
compute_slowdown = the 2-pod slowest pod's compute / the 1-pod compute (two busy cores share the
machine's memory: not the orchestration's). --variants runs each configuration in several step
variants, interleaved: "default" (the config's own dcn.overlap), "fused" (dcn.overlap=false),
"overlap" (dcn.overlap=true).

--netns: every pod (every host) in a network namespace of its own (controller/launch/netns.py),
pods joined through a kernel link, shaped with --netns-rate-gbps R. --link-fraction F picks R
instead: one pinned pod's backward pass is measured first (`python -m bench.overlap compute
--devices 1`, this model), and R makes sending one pod's gradient take F of it.

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
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pods import controller_flags, describe, pin, pinned_pods  # noqa: E402

# Small enough that its gradient (~13 MB) crosses the link quickly, with enough compute per step
# (>= 1 s on one core at the default batch) for the PaLM comparison.
MODEL = ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=64",
         "model.mlp_dim=1024", "model.max_seq_len=128", 'data.tokenizer="bytes"']


_TOKEN = secrets.token_hex(24)     # the workers and the controller share this run's secret


def _env() -> dict:
    # The caller's PYTHONPATH stays first: e.g. a folder whose `multipod` is a checkout of one
    # commit, to measure that commit rather than the editable install's working tree.
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join(parts + [str(ROOT)] * (str(ROOT) not in parts))
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", MULTIPOD_AUTH_TOKEN=_TOKEN)
    env.pop("XLA_FLAGS", None)
    # One core per pod: keep XLA's and BLAS's thread pools to that core.
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(cores: list[int], batch: int, seq_len: int, steps: int, settings: list[str], hosts_per_pod: int = 1,
        devices_per_host: int = 1, netns: bool = False, rate_gbps: float = 0.0, encrypt: bool = False) -> list[dict]:
    """Train `steps` steps on len(cores) pinned pods with per-pod batch `batch`; the metrics."""
    os.environ.update(_env())     # the workers' environment: LocalPods starts them with a copy of it
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        pods = pinned_pods(cores, folder / "workers", hosts_per_pod=hosts_per_pod, devices_per_host=devices_per_host,
                           netns=netns, rate_gbps=rate_gbps, encrypt=encrypt)
        with pods:
            overrides = [*MODEL, f"data.seq_len={seq_len}", f"data.global_batch={batch * len(cores)}",
                         "optimizer.warmup_steps=2", "sample.tokens=0", "eval.batches=0",
                         "run.step_timeout_s=600", *settings]
            cmd = [sys.executable, "-m", "multipod.cli", "train", "--workers", pods.workers,
                   "--steps", str(steps), "--seed", "1", "--run-dir", str(folder / "run"),
                   "--checkpoint-dir", str(folder / "checkpoints"), *controller_flags(pods)]
            for o in overrides:
                cmd += ["--set", o]
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=3000,
                                        stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"training on {len(cores)} pod(s) did not finish within 3000 s") from None
            if result.returncode:
                raise SystemExit(f"training on {len(cores)} pod(s) of {hosts_per_pod} host(s) failed:\n"
                                 f"{result.stderr[-3000:]}")
            records = [json.loads(l) for l in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
            where = describe(pods)
        for r in records:
            r["where"] = where
        return records


def summarise(runs: list[list[dict]], warmup: int) -> dict:
    """Medians over the timed steps of every run of one configuration."""
    timed = [r for records in runs for r in records if r["step"] >= warmup]
    med = lambda xs: round(statistics.median(xs), 4)
    pods = len(timed[0]["pods"])
    per_pod = [{k: med([r["pods"][p][k] for r in timed]) for k in ("compute_s", "exchange_s", "exposed_exchange_s",
                                                                    "idle_s", "update_s", "wait_s")}
               for p in range(pods)]
    step = med([r["step_time_s"] for r in timed])
    slowest = [max(p["compute_s"] for p in r["pods"]) for r in timed]
    busy = statistics.mean(p["compute_s"] + p["update_s"] for p in per_pod)
    return {
        "steps_timed": len(timed),
        "tokens_per_step": timed[0]["tokens"],
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1),
        "per_run_median_tokens_per_s": [round(statistics.median(r["tokens_per_s"] for r in rec
                                                                if r["step"] >= warmup), 1) for rec in runs],
        "median_step_s": step,
        "per_run_median_step_s": [med([r["step_time_s"] for r in rec if r["step"] >= warmup]) for rec in runs],
        "per_pod": per_pod,
        # The slowest pod's forward + backward, per step: what the step cannot be shorter than.
        "median_slowest_compute_s": med(slowest),
        # Per step, the slowest pod's compute over the step time (median over the steps); the rest
        # of the step (1 - this) is exposed exchange, idle, update and dispatch.
        "busy_fraction": med([c / r["step_time_s"] for c, r in zip(slowest, timed)]),
        # The older figure (before issue 20): mean (compute + update) over the median step.
        "compute_update_fraction": round(busy / step, 4),
        "dcn_bytes_sent_per_step": timed[0]["dcn_bytes_sent"],     # all pods together
        "dcn_bytes_sent_per_pod_per_step": int(statistics.median(p["dcn_bytes_sent"] for r in timed
                                                                 for p in r["pods"])),
        "loss_last": round(timed[-1]["loss"], 4),
        "pods_bitwise_identical_every_step": all(len(set(r["checksums"])) == 1 for r in timed),
        "where": timed[0].get("where", ""),
    }


def compare(one: dict, two: dict) -> dict:
    """The 1-pod vs 2-pod figures of one variant."""
    ratio = two["median_tokens_per_s"] / one["median_tokens_per_s"]
    busy_ratio = two["busy_fraction"] / one["busy_fraction"]
    return {
        "throughput_ratio": round(ratio, 4), "weak_scaling_efficiency": round(ratio / 2, 4),
        # What the orchestration controls: 1.0 when the 2-pod step adds nothing beyond its slowest
        # pod's compute that the 1-pod step does not have too (target >= 0.98).
        "busy_fraction_ratio": round(busy_ratio, 4),
        "orchestration_share_of_2pod_step": round(1 - busy_ratio, 4),
        # Reported apart: the pods' compute itself slows when both cores are busy.
        "compute_slowdown": round(two["median_slowest_compute_s"] / one["median_slowest_compute_s"], 4),
        "step_ratio": round(two["median_step_s"] / one["median_step_s"], 4),
    }


VARIANTS = {"default": [], "fused": ["dcn.overlap=false"], "overlap": ["dcn.overlap=true"]}


def calibrate_rate(args, fraction: float) -> dict:
    """The link rate at which sending one pod's gradient takes `fraction` of one pinned pod's
    backward pass: bench.overlap's compute mode on one device, pinned to core 0, this model and
    per-pod batch (backward = fused gradient program - forward)."""
    settings = [*MODEL, f"data.seq_len={args.seq_len}", f"data.global_batch={args.batch}"]
    cmd = [sys.executable, "-m", "bench.overlap", "compute", "--devices", "1", "--reps", "5"]
    for s in settings:
        cmd += ["--set", s]
    cmd = pin(0, cmd)
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SystemExit("the calibration (bench.overlap compute) did not finish within 900 s") from None
    if result.returncode:
        raise SystemExit(f"the calibration failed:\n{result.stderr[-3000:]}")
    out = json.loads(result.stdout)
    med = out["medians"]
    backward = med["fused_grad_s"] - med["forward_s"]
    rate = out["gradient_bytes"] * 8 / (fraction * backward) / 1e9
    return {"command": " ".join(cmd), "gradient_bytes": out["gradient_bytes"], "forward_s": med["forward_s"],
            "fused_grad_s": med["fused_grad_s"], "overlapped_grad_s": med["overlapped_grad_s"],
            "backward_s": round(backward, 4), "fraction": fraction, "rate_gbps": round(rate, 4)}


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
                                  devices_per_host=args.devices_per_pod // k, netns=args.netns,
                                  rate_gbps=args.netns_rate_gbps or 0.0, encrypt=args.netns_encrypt))
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
    parser.add_argument("--variants", default="default",
                        help=f"comma-separated step variants, each run 1-pod and 2-pod: {', '.join(VARIANTS)}")
    parser.add_argument("--netns", action="store_true",
                        help="each pod (each host) in a network namespace of its own, joined by kernel links "
                             "(needs root; see controller/launch/netns.py)")
    parser.add_argument("--netns-rate-gbps", type=float, default=None, metavar="R",
                        help="with --netns: shape each pod's link to R Gb/s each way (tbf)")
    parser.add_argument("--link-fraction", type=float, default=None, metavar="F",
                        help="with --netns and no --netns-rate-gbps: pick the rate at which sending one pod's "
                             "gradient takes F of a pinned pod's backward pass (measured first)")
    parser.add_argument("--netns-encrypt", action="store_true",
                        help="with --netns: TLS + CURVE with the run's own certificates (default: --insecure, "
                             "plain like gloo)")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs at least 2 CPU cores (one per pod)")
    if (args.netns_rate_gbps or args.link_fraction is not None or args.netns_encrypt) and not args.netns:
        raise SystemExit("--netns-rate-gbps, --link-fraction and --netns-encrypt go with --netns")
    unknown = set(args.variants.split(",")) - set(VARIANTS) - {""}
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
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
    netns = dict(netns=args.netns, rate_gbps=args.netns_rate_gbps or 0.0, encrypt=args.netns_encrypt)
    link: dict = {"netns": args.netns, "encrypted": args.netns_encrypt and args.netns}
    if args.link_fraction is not None and not args.netns_rate_gbps:
        link["calibration"] = calibrate_rate(args, args.link_fraction)
        netns["rate_gbps"] = link["calibration"]["rate_gbps"]
    link["rate_gbps"] = netns["rate_gbps"] or None
    variants = [v for v in args.variants.split(",") if v]
    # One pod and two pods, and the variants, alternate round by round, so that other load on the
    # machine affects all alike.
    runs: dict = {(v, n): [] for v in variants for n in (1, 2)}
    for round_ in range(args.rounds):
        order = variants if round_ % 2 == 0 else variants[::-1]
        for v in order:
            for n in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                runs[v, n].append(run(list(range(n)), args.batch, args.seq_len, args.steps,
                                      [*VARIANTS[v], *args.settings], **netns))
    result: dict = {}
    for v in variants:
        one, two = summarise(runs[v, 1], args.warmup), summarise(runs[v, 2], args.warmup)
        result[v] = {"one_pod": one, "two_pods": two, **compare(one, two)}
    if link["rate_gbps"]:
        grad_bytes = result[variants[0]]["two_pods"]["dcn_bytes_sent_per_pod_per_step"]
        link["seconds_per_gradient_at_rate"] = round(grad_bytes * 8 / (link["rate_gbps"] * 1e9), 4)
    print(json.dumps({
        "benchmark": "scaling", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average_start": load_start, "load_average_end": os.getloadavg(), "model": MODEL,
        "per_pod_batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
        "settings": args.settings, "rounds": args.rounds, "link": link, "variants": result,
    }, indent=2))


if __name__ == "__main__":
    main()
