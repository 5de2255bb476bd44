"""Benchmark: the overlapped gradient step (dcn.overlap) against the fused one.

    python -m bench.overlap compute [--config configs/bench.toml] [--devices 2] [--reps 15]
    python -m bench.overlap link [--config configs/bench.toml] [--devices-per-pod 1] [--steps 12]
                                 [--rounds 2] [--fraction 0.3] [--link-gbps G]
                                 [--netns [--netns-rate-gbps R]]
    python -m bench.overlap matrix [--configs configs/tiny.toml,configs/default.toml]
                                   [--layouts one-pod,plain,microbatches,hosts] [--steps 20] [--rounds 2]

compute: one pod, in this process, on --devices simulated CPU devices. Interleaved, --reps times
each after a warm-up: the fused gradient program (PodTrainer.gradients) and the overlapped
per-layer programs (overlap.OverlappedGradStep.launch, then every leaf ready), both on the same
parameters and batch; the forward pass alone (the evaluation program) gives the backward pass's
share. Then whole train_steps of a fused and an overlapped trainer, interleaved. Medians, and
overlapped / fused.

link: two pods (`multipod local`), the slow-link mode set so that sending one pod's gradient
takes --fraction of the backward pass. A first fused run without the slow link measures the
per-pod compute (forward + backward) of two pods sharing this machine; the backward pass is the
share of it the compute mode measures (--backward-share). Then --rounds rounds of one fused and
one overlapped run. With --netns the pods run in network namespaces of their own (`multipod local
--netns --insecure`) and the link is the kernel's: the rate (calibrated, or --netns-rate-gbps) shapes
each pod's veth link (tbf) instead of the workers' token bucket (dcn.link_gbps); the latency stays
dcn.link_latency_ms (this kernel has no netem). Per step (the first two skipped: compile and
warm-up): exposed_exchange_s over the step time, for the pod with the most and for the pod with
the least (see _summarise). Medians per setting.

matrix: is the default (dcn.overlap = auto) slower than the fused step (dcn.overlap = false), and
what would the overlapped step (true) take? For each config and layout, --rounds rounds of one
run of each `multipod local` on loopback, the order rotating, every cell's runs interleaved with
the others' in each round. Layouts: one-pod (1 pod of 1 device, no exchange), plain (2 pods
of 1 device), microbatches (the same with model.microbatches = 2), hosts (2 pods of 2 hosts of 1
device). Per cell: the median step_time_s over the steps of its runs (the first two of each run
skipped: compile and warm-up), overlap / fused and default / fused, whether the pods were bitwise
identical, and the step the default chose (the first worker log's "the gradient step" line).

--set KEY=VALUE (any mode, repeatable) overrides the config, e.g. the model of bench/scaling.py.

Prints one JSON object.
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
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def compute(args) -> dict:
    from multipod.pod_worker.devices import simulate_cpu_devices
    simulate_cpu_devices(args.devices, overwrite=True)
    import dataclasses

    import jax
    import numpy as np

    from multipod.controller.core.run_config import load_config
    from multipod.pod_worker.trainer import PodTrainer

    config = load_config(args.config, args.settings).worker_config()
    on = dataclasses.replace(config, dcn=dataclasses.replace(config.dcn, overlap=True)).validate()
    off = dataclasses.replace(config, dcn=dataclasses.replace(config.dcn, overlap=False)).validate()
    rows = config.train.global_batch       # one pod holds the whole batch
    shape = (rows, config.train.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, shape).astype(np.int32)
    global_tokens = rows * config.train.seq_len

    trainer = PodTrainer(on)               # holds both the fused and the overlapped programs
    trainer.compile_for(shape)
    batch = trainer.put_batch(tokens)
    norm = jax.device_put(np.float32(global_tokens), trainer.scalar_sharding)

    def fused():
        grads, _, _ = trainer.gradients(batch, global_tokens)
        jax.block_until_ready(grads)

    def overlapped():
        launched = trainer._overlapped.launch(trainer.params, batch, norm)
        jax.block_until_ready(launched.leaves)
        float(launched.ce)

    def forward():
        ce, _ = trainer._eval_step(trainer.params, batch)
        float(ce)

    times: dict[str, list[float]] = {"fused_grad_s": [], "overlapped_grad_s": [], "forward_s": []}
    for _ in range(2):                      # warm-up (compiles the jitted ones)
        fused(), overlapped(), forward()
    for rep in range(args.reps):
        runs = [("fused_grad_s", fused), ("overlapped_grad_s", overlapped), ("forward_s", forward)]
        if rep % 2:
            runs[0], runs[1] = runs[1], runs[0]
        for name, fn in runs:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    # Whole steps: two trainers, same start, one update per step each.
    step_trainers = {"fused_step_s": PodTrainer(off), "overlapped_step_s": PodTrainer(on)}
    step_times: dict[str, list[float]] = {name: [] for name in step_trainers}
    exposed = []
    for rep in range(args.reps + 2):
        for name, tr in (step_trainers.items() if rep % 2 == 0 else reversed(step_trainers.items())):
            start = time.perf_counter()
            outcome = tr.train_step(tr.put_batch(tokens), global_tokens)
            if rep >= 2:
                step_times[name].append(time.perf_counter() - start)
                if name == "overlapped_step_s":
                    exposed.append(outcome.exposed_exchange_s)

    med = {name: statistics.median(v) for name, v in {**times, **step_times}.items()}
    grad_bytes = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in trainer.leaf_specs)
    backward = med["fused_grad_s"] - med["forward_s"]
    return {
        "mode": "compute", "config": str(args.config), "devices": args.devices, "reps": args.reps,
        "batch": list(shape), "params": config.model.param_count(), "gradient_bytes": grad_bytes,
        "medians": med,
        "overlapped_over_fused_grad": med["overlapped_grad_s"] / med["fused_grad_s"],
        "overlapped_over_fused_step": med["overlapped_step_s"] / med["fused_step_s"],
        "backward_share_of_grad": backward / med["fused_grad_s"],
        "one_pod_exposed_exchange_s_median": statistics.median(exposed),
        "load_average": _load_avg(), "cpus": os.cpu_count(),
    }


def _local_run(args, run_dir: pathlib.Path, settings: list[str], netns_rate_gbps: float | None = None,
               layout: list[str] | None = None, config: str | None = None) -> list[dict]:
    """netns_rate_gbps: None on loopback; with --netns, 0 (unshaped) or the link's rate. layout:
    the pods' flags (default 2 pods of --devices-per-pod devices); config: default --config."""
    layout = layout or ["--pods", "2", "--devices-per-pod", str(args.devices_per_pod)]
    cmd = [sys.executable, "-m", "multipod.cli", "local", *layout, "--config", str(config or args.config),
           "--steps", str(args.steps), "--run-dir", str(run_dir), "--set", "sample.tokens=0",
           "--set", "eval.batches=0", "--checkpoint-every", "0"]
    if netns_rate_gbps is not None:
        # Plain, as the comparisons with gloo are: CURVE would add its own CPU cost to the link's.
        cmd += ["--netns", "--insecure"] + (["--netns-rate-gbps", f"{netns_rate_gbps:.6f}"] if netns_rate_gbps else [])
    for s in [*args.settings, *settings]:
        cmd += ["--set", s]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines][2:]      # skip compile and warm-up


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summarise(records: list[dict]) -> dict:
    """Medians over steps. A pod's exposed_exchange_s also holds its wait for a peer whose backward
    pass ends later (the two pods share the cores unevenly): the largest over the pods is the
    metric as defined; the smallest is the pod that finished its backward pass last, i.e. what
    the exchange adds after the step's slowest backward pass."""
    def exposed(r, pick):
        pods = [p.get("exposed_exchange_s") for p in r["pods"]]
        return None if None in pods else pick(pods)

    def fraction(r, pick):
        value = exposed(r, pick)
        return None if value is None else value / r["step_time_s"]
    return {
        "steps": len(records),
        "step_time_s": _median([r["step_time_s"] for r in records]),
        "compute_s": _median([p["compute_s"] for r in records for p in r["pods"]]),
        "exchange_s": _median([p["exchange_s"] for r in records for p in r["pods"]]),
        "exposed_exchange_s_max_pod": _median([exposed(r, max) for r in records]),
        "exposed_fraction_of_step_max_pod": _median([fraction(r, max) for r in records]),
        "exposed_exchange_s_last_pod": _median([exposed(r, min) for r in records]),
        "exposed_fraction_of_step_last_pod": _median([fraction(r, min) for r in records]),
        "checksums_equal_every_step": all(len(set(r["checksums"])) == 1 for r in records),
        "losses": [round(r["loss"], 6) for r in records],
    }


def link(args) -> dict:
    from multipod.controller.core.run_config import load_config
    config = load_config(args.config, args.settings)
    grad_bytes = config.model.param_count() * 4
    out: dict = {"mode": "link", "config": str(args.config), "devices_per_pod": args.devices_per_pod,
                 "steps_per_run": args.steps, "gradient_bytes": grad_bytes, "fraction": args.fraction,
                 "load_average_start": _load_avg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        tmp = pathlib.Path(tmp)
        gbps = args.netns_rate_gbps if args.netns else args.link_gbps
        unshaped = 0.0 if args.netns else None     # the calibration runs without the slow link
        if gbps is None:
            share = args.backward_share
            calib = _summarise(_local_run(args, tmp / "calibrate", ["dcn.overlap=false"], unshaped))
            backward = calib["compute_s"] * share
            # Seconds to send one pod's gradient = fraction x backward pass.
            gbps = grad_bytes * 8 / (args.fraction * backward) / 1e9
            out["calibration"] = {"fused_no_slow_link": calib, "backward_share": share, "backward_s": backward}
        out["link_gbps"], out["link_latency_ms"] = gbps, args.link_latency_ms
        out["link"] = "kernel (netns, tbf)" if args.netns else "token bucket (dcn.link_gbps)"
        link_settings = [f"dcn.link_latency_ms={args.link_latency_ms}"]
        if not args.netns:
            link_settings.append(f"dcn.link_gbps={gbps:.6f}")
        per: dict[str, list[dict]] = {"fused": [], "overlapped": []}
        for round_ in range(args.rounds):
            names = ["fused", "overlapped"] if round_ % 2 == 0 else ["overlapped", "fused"]
            for name in names:
                overlap = "true" if name == "overlapped" else "false"
                per[name] += _local_run(args, tmp / f"{name}-{round_}", [*link_settings, f"dcn.overlap={overlap}"],
                                        gbps if args.netns else None)
        out.update({name: _summarise(records) for name, records in per.items()})
    out["load_average_end"] = _load_avg()
    return out


# matrix mode: each layout's `multipod local` flags and settings.
LAYOUTS = {
    "one-pod": (["--pods", "1", "--devices-per-pod", "1"], []),
    "plain": (["--pods", "2", "--devices-per-pod", "1"], []),
    "microbatches": (["--pods", "2", "--devices-per-pod", "1"], ["model.microbatches=2"]),
    "hosts": (["--pods", "2", "--hosts-per-pod", "2", "--devices-per-host", "1"], []),
}
# The fused step, the overlapped step, and the default (dcn.overlap as the config leaves it: auto).
SETTINGS = {"fused": ["dcn.overlap=false"], "overlap": ["dcn.overlap=true"], "default": []}


def _chosen_step(run_dir: pathlib.Path) -> str:
    """The gradient step a run's first worker logged it runs (trainer.compile_for)."""
    for log in sorted(run_dir.glob("worker-*.log")):
        for line in log.read_text().splitlines():
            if "the gradient step: " in line:
                return line.split("the gradient step: ", 1)[1]
    return "?"


def matrix(args) -> dict:
    configs, layouts = args.configs.split(","), args.layouts.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    out: dict = {"mode": "matrix", "steps_per_run": args.steps, "rounds": args.rounds, "settings": args.settings,
                 "load_average_start": _load_avg(), "cpus": os.cpu_count(), "cells": []}
    records: dict[tuple, list] = {(c, lay, name): [] for c in configs for lay in layouts for name in SETTINGS}
    chosen: dict[tuple, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-matrix-") as tmp:
        for round_ in range(args.rounds):
            for c in configs:
                for lay in layouts:
                    names = list(SETTINGS)[round_ % len(SETTINGS):] + list(SETTINGS)[:round_ % len(SETTINGS)]
                    for name in names:
                        flags, settings = LAYOUTS[lay]
                        run_dir = pathlib.Path(tmp) / f"{pathlib.Path(c).stem}-{lay}-{name}-{round_}"
                        records[(c, lay, name)] += _local_run(args, run_dir, [*settings, *SETTINGS[name]],
                                                              layout=flags, config=c)
                        if name == "default":
                            chosen[(c, lay)] = _chosen_step(run_dir)
    for c in configs:
        for lay in layouts:
            cell = {"config": c, "layout": lay}
            for name in SETTINGS:
                rs = records[(c, lay, name)]
                cell[name] = {"steps": len(rs), "step_time_s": _median([r["step_time_s"] for r in rs]),
                              "checksums_equal_every_step": all(len(set(r["checksums"])) == 1 for r in rs)}
            cell["overlap_over_fused"] = cell["overlap"]["step_time_s"] / cell["fused"]["step_time_s"]
            cell["default_over_fused"] = cell["default"]["step_time_s"] / cell["fused"]["step_time_s"]
            cell["default_chose"] = chosen[(c, lay)]
            out["cells"].append(cell)
    out["load_average_end"] = _load_avg()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("compute")
    c.add_argument("--config", default=str(ROOT / "configs" / "bench.toml"))
    c.add_argument("--devices", type=int, default=2)
    c.add_argument("--reps", type=int, default=15)
    lk = sub.add_parser("link")
    lk.add_argument("--config", default=str(ROOT / "configs" / "bench.toml"))
    lk.add_argument("--devices-per-pod", type=int, default=1)
    lk.add_argument("--steps", type=int, default=12)
    lk.add_argument("--rounds", type=int, default=2)
    lk.add_argument("--fraction", type=float, default=0.3)
    lk.add_argument("--backward-share", type=float, default=0.62,
                    help="backward pass / (forward + backward), from the compute mode")
    lk.add_argument("--link-gbps", type=float, default=None, help="skip the calibration run")
    lk.add_argument("--link-latency-ms", type=float, default=1.0)
    lk.add_argument("--netns", action="store_true",
                    help="pods in network namespaces (multipod local --netns --insecure): the rate shapes the "
                         "kernel's link instead of dcn.link_gbps (needs root)")
    lk.add_argument("--netns-rate-gbps", type=float, default=None, metavar="R",
                    help="with --netns: the link's rate (skips the calibration run)")
    mx = sub.add_parser("matrix")
    mx.add_argument("--configs", default=",".join(str(ROOT / "configs" / f) for f in ("tiny.toml", "default.toml")))
    mx.add_argument("--layouts", default=",".join(LAYOUTS))
    mx.add_argument("--steps", type=int, default=20)
    mx.add_argument("--rounds", type=int, default=2)
    mx.set_defaults(devices_per_pod=1)
    for p in (c, lk, mx):
        p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                       help="config override (repeatable)")
    args = parser.parse_args(argv)
    if args.mode == "link" and args.netns_rate_gbps is not None and not args.netns:
        parser.error("--netns-rate-gbps goes with --netns")
    result = {"compute": compute, "link": link, "matrix": matrix}[args.mode](args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
