"""The per-step state checksum's share of a step (computed on the devices: what a step takes
now) against the fingerprint's (BLAKE2b of host copies: what every step took before, and what
checkpoints and every run.fingerprint_every-th step still take), interleaved in one process on
the same state. Prints one JSON object of medians.

    python -m bench.checksum [--config configs/bench.toml] [--devices 2] [--steps 10] [--set KEY=VALUE ...]

step_s: one whole training step (train_step, one pod, no exchange) including the checksum;
checksum_s: the step's checksum_s; blake2b_s: trainer.fingerprint() on the same state right
after the step. Fractions are of step_s (for the BLAKE2b, of the step it would have been:
step_s - checksum_s + blake2b_s).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench.toml"),
                        help="TOML config (default: configs/bench.toml, the model docs/benchmarks.md measures)")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices of the pod")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up step)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, as for multipod (e.g. mesh.model=2 for a model-parallel pod)")
    args = parser.parse_args()
    from multipod.pod_worker.devices import simulate_cpu_devices
    simulate_cpu_devices(args.devices, overwrite=False)
    import numpy as np

    from multipod.controller.core.run_config import load_config
    from multipod.controller.data.batches import token_dtype
    from multipod.pod_worker.trainer import PodTrainer

    config = load_config(args.config, ["sample.tokens=0", *args.set])
    worker = config.worker_config()
    trainer = PodTrainer(worker)
    rows, cols = config.data.global_batch, config.data.seq_len + 1
    trainer.compile_for((rows, cols))
    global_tokens = rows * (cols - 1)
    steps, checksums, blakes = [], [], []
    for step in range(args.steps + 1):
        tokens = np.random.default_rng(step).integers(0, worker.model.vocab_size, (rows, cols))
        batch = trainer.put_batch(tokens.astype(token_dtype(worker.model.vocab_size)))
        start = time.perf_counter()
        outcome = trainer.train_step(batch, global_tokens)
        step_s = time.perf_counter() - start
        start = time.perf_counter()
        trainer.fingerprint()
        blake_s = time.perf_counter() - start
        if step:                       # the first step is warm-up
            steps.append(step_s)
            checksums.append(outcome.checksum_s)
            blakes.append(blake_s)
    step_s, checksum_s, blake_s = (statistics.median(v) for v in (steps, checksums, blakes))
    print(json.dumps({
        "config": args.config or "defaults", "settings": args.set, "devices": args.devices, "steps": args.steps,
        "param_count": sum(s.nbytes // s.dtype.itemsize for s in trainer.leaf_specs),
        "load_average": os.getloadavg(),
        "step_s": step_s, "checksum_s": checksum_s, "blake2b_s": blake_s,
        "checksum_fraction": checksum_s / step_s,
        "blake2b_fraction": blake_s / (step_s - checksum_s + blake_s),
    }, indent=2))


if __name__ == "__main__":
    main()
