"""`multipod tune`: search one pod's layout (mesh, sequence parallelism, microbatches, remat).

The grid (controller/tune/grid.py): every (data x model) mesh of the pod's devices whose model axis
divides the sharded dimensions (heads, MLP width, vocabulary); sequence parallelism on and off (on
only where the model axis is > 1: with one model shard it is the same program); the microbatch
counts that split each data shard evenly; the remat policies. Explicitly requested values
(--meshes, --microbatches, ...) are tried as given, so an impossible one is reported with its error.

Every candidate is compiled once by the pod-side layout probe (pod_worker/layout_probe.py), in a
child process that has the pod's simulated device count (controller/tune/runner.py). Candidates
whose compiled per-device memory exceeds --memory-limit are reported and not timed; the others run
the trainer's own step a few times and report the median. A candidate that fails to compile or run
-- or crashes or hangs the probe -- is reported with its error and the search goes on in a fresh
probe. The ranked table, its JSON and the best config come from controller/tune/table.py. Across
pods the DCN axis is always data-parallel, so tuning one pod's layout is tuning the run's: every
pod uses the same layout.

`multipod tune --inference` searches the layout for generation instead (mesh x generation batch,
ranked by tokens/s within --max-latency-ms): controller/tune/inference.py. `multipod tune --dcn`
chooses the cross-pod [dcn]/[sync] settings for the measured link: controller/tune/dcn_session.py.
"""
from __future__ import annotations

import argparse
import pathlib
import time

from multipod.controller.tune.dcn_session import add_arguments as add_dcn_arguments
from multipod.controller.tune.grid import (
    Candidate,
    candidate_config,
    enumerate_candidates,
    parse_bytes,
    parse_int_list,
    parse_mesh_list,
    parse_remat_list,
)
from multipod.controller.tune.inference import add_arguments as add_inference_arguments, check_mode

DCN_NOTE = ("Tuning one pod's layout: across pods the DCN axis is always data-parallel, so every pod "
            "uses this layout and the global batch is split evenly over the pods.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `multipod tune`."""
    parser.add_argument("--config", help="TOML config file with the model to tune (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--devices", type=int, default=2, help="devices in one pod (simulated on CPU; default 2)")
    parser.add_argument("--pods", type=int,
                        help="pods the global batch is split over (default 1; --dcn: pods to start, default 2); "
                             "each pod gets global_batch/pods")
    parser.add_argument("--global-batch", type=int, help="sequences per step over all pods (data.global_batch)")
    parser.add_argument("--memory-limit", type=parse_bytes,
                        help="drop candidates whose compiled per-device memory exceeds this (e.g. 2GiB)")
    parser.add_argument("--meshes", type=parse_mesh_list, help="only these DATAxMODEL meshes, e.g. 2x2,4x1")
    parser.add_argument("--microbatches", type=parse_int_list, help="only these microbatch counts, e.g. 1,2,4")
    parser.add_argument("--remat", type=parse_remat_list,
                        help="only these remat policies, comma-separated (the values of model.remat)")
    parser.add_argument("--sequence-parallel", choices=("both", "on", "off"), default="both",
                        help="try sequence parallelism on, off, or both (default both)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps per candidate (--inference: timed generations; median; default 5)")
    parser.add_argument("--candidate-timeout", type=float, default=600.0,
                        help="seconds one candidate may take to compile and run (default 600)")
    parser.add_argument("--peak-flops", type=float,
                        help="peak FLOP/s of one device for MFU/HFU (default: the stored `multipod "
                             "peak-flops` measurement, else measured now)")
    parser.add_argument("--out", default="tuned.toml",
                        help="where to write the best candidate's config (default tuned.toml)")
    parser.add_argument("--json", dest="json_path", help="also write the ranked table as JSON here")
    add_inference_arguments(parser)
    add_dcn_arguments(parser)


def _resolve_peak(given: float | None, info: dict, devices: int) -> float | None:
    """--peak-flops, else the stored measurement for the probe's device kind, else measured now."""
    from multipod.controller.observe.metrics import load_measured_peak, out
    if given is not None or not info:
        return given
    peak = load_measured_peak(info["device_kind"], devices)
    if peak is None:
        from multipod.controller.observe.peak import measure
        out("measuring the devices' peak FLOP/s for MFU/HFU (store one with `multipod peak-flops`)")
        peak = measure(devices)["per_device_flops"]
    return peak


def check_outputs(args: argparse.Namespace) -> None:
    """ConfigError naming the flag whose file cannot be written (--out, --json, --plan-out),
    before a search that takes minutes finds out at its end."""
    import os

    from multipod.controller.core.run_config import ConfigError
    outputs = (("--out", args.out), ("--json", args.json_path), ("--plan-out", getattr(args, "plan_out", None)))
    for flag, value in outputs:
        if not value:
            continue
        path = pathlib.Path(value)
        folder = path.absolute().parent
        if path.is_dir():
            raise ConfigError(flag, f"{value} is a directory: give the file to write")
        if not folder.is_dir() or not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(flag, f"{value} cannot be written (is {folder} a writable directory?)")


def main(args: argparse.Namespace) -> int:
    """Run `multipod tune`; returns the exit code (0: a best candidate was written)."""
    check_outputs(args)
    if args.dcn:         # the cross-pod settings: controller/tune/dcn_session.py
        from multipod.controller.core.run_config import ConfigError
        if args.inference:
            raise ConfigError("--dcn", "chooses the training run's cross-pod settings: not with --inference")
        from multipod.controller.tune.dcn_session import main as dcn_main
        return dcn_main(args)
    args.pods = 1 if args.pods is None else args.pods
    check_mode(args)
    if args.inference:   # the generation layout search: controller/tune/inference.py
        from multipod.controller.tune.inference import main as inference_main
        return inference_main(args)
    from multipod.controller.core.run_config import ConfigError, load_config
    from multipod.controller.observe.metrics import out
    from multipod.controller.tune.runner import run_grid
    from multipod.controller.tune.table import best_row, mib, print_table, rank, write_config, write_report
    overrides = list(args.overrides)
    if args.global_batch is not None:
        overrides.append(f"data.global_batch={args.global_batch}")
    config = load_config(args.config, overrides)
    for name, value in (("--devices", args.devices), ("--pods", args.pods), ("--steps", args.steps)):
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}")
    if not args.candidate_timeout > 0:
        raise ConfigError("--candidate-timeout", f"must be > 0 seconds, got {args.candidate_timeout:g}")
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

    started = time.perf_counter()
    results, info = run_grid(config, candidates, args.devices, per_pod, args.steps, args.memory_limit,
                             args.candidate_timeout)
    peak = _resolve_peak(args.peak_flops, info, args.devices)
    tokens_per_step = per_pod * config.data.seq_len
    table = rank(candidates, results, config.model.flops_per_token(config.data.seq_len), tokens_per_step, peak,
                 args.devices)
    elapsed = time.perf_counter() - started
    print_table(table, f"multipod tune: {len(candidates)} candidates for one pod of {args.devices} device(s) "
                       f"in {elapsed:.0f}s (peak {peak / 1e9:.1f} GFLOP/s per device)" if peak else
                       f"multipod tune: {len(candidates)} candidates in {elapsed:.0f}s")
    out(DCN_NOTE)
    best = best_row(table)
    if args.json_path:
        write_report(args.json_path, table, devices=args.devices, pods=args.pods, per_pod_batch=per_pod,
                     seq_len=config.data.seq_len, memory_limit=args.memory_limit, peak_flops=peak,
                     device_kind=info.get("device_kind"), note=DCN_NOTE, skipped=skipped)
        out(f"table written to {args.json_path}")
    if best is None:
        out("no candidate ran within the limits: no config written")
        return 1
    choice = Candidate(best["data"], best["model"], best["sequence_parallel"], best["microbatches"], best["remat"])
    header = [f"written by `multipod tune`: the fastest of {len(candidates)} candidates for one pod of "
              f"{args.devices} device(s)", f"{choice.label()}: {best['step_time_s'] * 1e3:.1f} ms/step, "
              f"{mib(best.get('memory_bytes'))} MiB per device", DCN_NOTE]
    write_config(args.out, candidate_config(config, choice), header)
    out(f"best: {choice.label()} -> {args.out} (train with `multipod local --pods {args.pods} "
        f"--devices-per-pod {args.devices} --config {args.out}`)")
    return 0
