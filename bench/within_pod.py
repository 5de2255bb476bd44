"""Benchmark: within-pod layouts of the default model on one simulated 4-device pod.

    python -m bench.within_pod [--config configs/bench.toml] [--devices 4] [--steps 5]

For every combination of mesh (data x model), sequence parallelism (on/off; on only where the
model axis is > 1) and remat policy (none/full/selective), with one microbatch: the compiled
step's per-device memory (XLA memory analysis), its hardware FLOPs (XLA cost analysis), the
median step time over --steps steps after a warm-up step, tokens/s, MFU and HFU. Each layout is
compiled once in a child process with the pod's device count (the same code as `multipod tune`).
Peak FLOP/s for MFU/HFU: --peak-flops, else measured here with `multipod peak-flops`'s method
for the same device count. Also the activation bytes the backward pass keeps per remat policy
(jax's saved residuals for the pod's batch, before XLA's buffer reuse). Prints one JSON object:
the rows and the ratios derived from them.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time


def _ratios(rows: list[dict]) -> dict:
    by_key = {(r["mesh"], r["sequence_parallel"], r["remat"]): r for r in rows if r["status"] == "ok"}
    out: dict = {"sequence_parallel_memory": {}, "remat_temp_vs_none": {}, "remat_hw_flops_vs_none": {},
                 "remat_step_time_vs_none": {}}
    for (mesh, sp, remat), row in by_key.items():
        if sp:
            plain = by_key.get((mesh, False, remat))
            if plain:
                out["sequence_parallel_memory"][f"{mesh} remat={remat}"] = {
                    "peak_on_over_off": row["peak_bytes"] / plain["peak_bytes"],
                    "temp_on_over_off": row["temp_bytes"] / plain["temp_bytes"],
                    "step_time_on_over_off": row["step_time_s"] / plain["step_time_s"]}
        none = by_key.get((mesh, sp, "none"))
        if remat != "none" and none:
            key = f"{mesh} sp={'on' if sp else 'off'} {remat}"
            out["remat_temp_vs_none"][key] = row["temp_bytes"] / none["temp_bytes"]
            out["remat_hw_flops_vs_none"][key] = row["hardware_flops_per_step"] / none["hardware_flops_per_step"]
            out["remat_step_time_vs_none"][key] = row["step_time_s"] / none["step_time_s"]
    return out


def saved_activation_bytes(model_cfg, rows: int, seq_len: int) -> dict:
    """Bytes the backward pass keeps from the forward (jax's saved residuals, parameters excluded)
    for `rows` sequences, per remat policy: the activation memory remat is about, before XLA's
    scheduling and buffer reuse. Uses a private jax helper; benchmark-only."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.ad_checkpoint import saved_residuals

    from multipod.model import abstract_params, loss_sums
    from multipod.model.config import RematPolicy
    result = {}
    for remat in RematPolicy:
        cfg = dataclasses.replace(model_cfg, remat=remat)
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.unbox(abstract_params(cfg)))
        tokens = jnp.zeros((rows, seq_len + 1), jnp.int32)
        saved = saved_residuals(lambda p, tokens=tokens, cfg=cfg: sum(loss_sums(p, tokens, cfg)), params)
        result[remat] = int(sum(np.prod(aval.shape) * aval.dtype.itemsize
                                for aval, where in saved if "argument" not in where))
    return result


_INTERLEAVED = r"""
import json, sys, time
spec = json.loads(sys.stdin.read())
from multipod.pod_worker.devices import simulate_cpu_devices
simulate_cpu_devices(spec["devices"])
from multipod.pod_worker.schema import WorkerConfig
from multipod.pod_worker.layout_probe import random_tokens
from multipod.pod_worker.trainer import PodTrainer
trainers = []
for worker_json in spec["candidates"]:
    config = WorkerConfig.from_json(worker_json)
    tokens = random_tokens(config.model.vocab_size, spec["batch"], config.train.seq_len)
    global_tokens = config.train.global_batch * config.train.seq_len
    t = PodTrainer(config)
    t.compile_for(tokens.shape)
    batch = t.put_batch(tokens)
    t.train_step(batch, global_tokens)  # warm-up
    trainers.append((t, batch, global_tokens))
times = [[] for _ in trainers]
for _ in range(spec["rounds"]):  # round-robin: a load change on the machine hits every layout alike
    for i, (t, batch, global_tokens) in enumerate(trainers):
        t0 = time.perf_counter()
        t.train_step(batch, global_tokens)
        times[i].append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def interleaved_step_times(config, candidates, devices: int, batch: int, rounds: int) -> list[list[float]]:
    """Step times of every candidate (the trainer's own step), all compiled in one process with the
    pod's device count and timed round-robin. The child gets each layout's WorkerConfig as JSON."""
    import os
    import subprocess

    from multipod.controller.tune.grid import candidate_worker_json
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    spec = {"devices": devices, "batch": batch, "rounds": rounds,
            "candidates": [candidate_worker_json(config, c) for c in candidates]}
    result = subprocess.run([sys.executable, "-c", _INTERLEAVED], input=json.dumps(spec), capture_output=True,
                            text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"interleaved timing failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench.toml"),
                        help="TOML config (default: configs/bench.toml, the model docs/benchmarks.md measures)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--peak-flops", type=float)
    parser.add_argument("--candidate-timeout", type=float, default=900.0)
    parser.add_argument("--interleaved-rounds", type=int, default=0,
                        help="also time every layout round-robin in one process for N rounds (robust to a "
                             "shared machine's load changes)")
    args = parser.parse_args()

    from multipod.controller.core.run_config import load_config
    from multipod.controller.observe.metrics import mfu
    from multipod.controller.observe.peak import measure
    from multipod.controller.tune.grid import enumerate_candidates
    from multipod.controller.tune.runner import run_grid
    from multipod.controller.tune.table import rank

    config = load_config(args.config)
    batch = config.data.global_batch
    candidates, skipped = enumerate_candidates(config.model, batch, args.devices, microbatches=[args.microbatches])
    peak_info = None
    peak = args.peak_flops
    if peak is None:  # measured first, close in time to the steps it is the denominator for
        peak_info = measure(args.devices)
        peak = peak_info["per_device_flops"]
    started = time.perf_counter()
    results, info = run_grid(config, candidates, args.devices, batch, args.steps, None, args.candidate_timeout)
    tokens = batch * config.data.seq_len
    flops_per_token = config.model.flops_per_token(config.data.seq_len)
    table = rank(candidates, results, flops_per_token, tokens, peak, args.devices)
    keep = ("rank", "mesh", "sequence_parallel", "microbatches", "remat", "status", "error", "step_time_s",
            "step_times_s", "tokens_per_s", "mfu", "hfu", "peak_bytes", "argument_bytes", "output_bytes",
            "temp_bytes", "update_peak_bytes", "hardware_flops_per_step", "model_flops_per_step", "compile_s")
    rows = [{k: r.get(k) for k in keep} for r in table]
    report = {
        "benchmark": "within_pod", "devices": args.devices, "device_kind": info.get("device_kind"),
        "model": {k: getattr(config.model, k) for k in ("d_model", "n_layers", "n_heads", "head_dim", "mlp_dim",
                                                        "vocab_size")},
        "param_count": config.model.param_count(), "batch": batch, "seq_len": config.data.seq_len,
        "steps_timed": args.steps, "peak_flops_per_device": peak, "peak_measurement": peak_info,
        "skipped": skipped, "wall_s": time.perf_counter() - started,
        "median_step_time_s_all": statistics.median(r["step_time_s"] for r in rows if r["step_time_s"]),
        "rows": rows, "ratios": _ratios(rows),
        "saved_activation_bytes_per_pod_batch": saved_activation_bytes(config.model, batch, config.data.seq_len),
    }
    if args.interleaved_rounds:
        times = interleaved_step_times(config, candidates, args.devices, batch, args.interleaved_rounds)
        medians = {c.label(): statistics.median(t) for c, t in zip(candidates, times)}
        fastest = min(medians.values())
        report["interleaved"] = {
            "rounds": args.interleaved_rounds,
            "rows": [{"layout": c.label(), "step_times_s": t, "median_s": medians[c.label()],
                      "tokens_per_s": tokens / medians[c.label()],
                      "mfu": mfu(tokens / medians[c.label()], flops_per_token, peak, args.devices),
                      "relative_to_fastest": medians[c.label()] / fastest}
                     for c, t in sorted(zip(candidates, times), key=lambda ct: medians[ct[0].label()])]}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
