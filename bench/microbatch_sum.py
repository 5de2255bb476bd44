"""What the fixed-order microbatch sum (pod_worker/accumulate.py) costs a healthy fused step: the
former fused step (programs.make_grad_step: one program, a scan over the microbatches summing
from zeros inside it) against the step now (PodTrainer.gradients: one program per microbatch's
gradient, then separate add programs), same model, same shard, one simulated device, interleaved
rounds, medians. Run it pinned to one core: `taskset -c 0 python -m bench.microbatch_sum`.

Prints one JSON object."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from multipod.pod_worker.devices import simulate_cpu_devices

simulate_cpu_devices(1, overwrite=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from multipod.model import ModelConfig  # noqa: E402
from multipod.model.partitioning import activate_rules  # noqa: E402
from multipod.pod_worker import programs  # noqa: E402
from multipod.pod_worker.schema import DcnConfig, MeshConfig, OptimizerConfig, TrainShape, WorkerConfig  # noqa: E402
from multipod.pod_worker.trainer import PodTrainer  # noqa: E402

# bench/failover_split.py's compute-bound model and shard.
MODEL = ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, mlp_dim=1024, max_seq_len=128)
ROWS, SEQ = 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    model = dataclasses.replace(MODEL, microbatches=args.microbatches)
    config = WorkerConfig(model=model, optimizer=OptimizerConfig(), mesh=MeshConfig(data=1, model=1),
                          train=TrainShape(seed=0, total_steps=10, seq_len=SEQ, global_batch=ROWS),
                          dcn=DcnConfig(overlap=False)).validate()
    trainer = PodTrainer(config)
    trainer.compile_for((ROWS, SEQ + 1))
    tokens = np.random.default_rng(0).integers(0, 256, (ROWS, SEQ + 1), dtype=np.int32)
    batch = trainer.put_batch(tokens)
    norm = trainer._normalizer(ROWS * SEQ)
    p, b, s = trainer.param_sharding, trainer.batch_sharding, trainer.scalar_sharding
    with activate_rules(trainer.mesh):
        scan = jax.jit(programs.make_grad_step(model), in_shardings=(p, b, s), out_shardings=(p, s, s)).lower(
            trainer.params, batch, norm).compile()

    def former():
        jax.block_until_ready(scan(trainer.params, batch, norm))

    def now():
        jax.block_until_ready(trainer._dispatch_gradients(batch, norm, to_host=False))

    times: dict[str, list[float]] = {"scan_from_zeros": [], "fixed_order_sum": []}
    for r in range(args.rounds + 1):
        for name, run in (("scan_from_zeros", former), ("fixed_order_sum", now))[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            run()
            if r:       # round 0 warms up
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"microbatches": args.microbatches, "rows": ROWS, "seq_len": SEQ, "rounds": args.rounds,
                      "median_s": {k: round(v, 4) for k, v in med.items()},
                      "fixed_order_over_scan": round(med["fixed_order_sum"] / med["scan_from_zeros"], 4),
                      "affinity": sorted(os.sched_getaffinity(0)), "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
