"""The model's forward and backward pass with the MLP's weight gradients taken from a transposed
copy of the activations (model/layers.py `dense`, what every step runs on CPU) against the plain
matmul it replaced, interleaved in one process on the same parameters and tokens. Prints one
JSON object of medians.

    python -m bench.mlp_grad [--config configs/vs_maxtext.toml] [--batch 4] [--rounds 5] [--steps 5]

Each round times --steps calls of each contender's jitted value_and_grad of the loss, in an order
that alternates between rounds. Pin it to a core (taskset -c 1) to measure one pod's compute as
bench/vs_maxtext.py runs it. Also reports the largest difference between the two gradients
(the same sums in another order).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "vs_maxtext.toml"),
                        help="TOML config whose [model] is timed (default: configs/vs_maxtext.toml)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per call (one pod's share)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed calls per contender per round")
    args = parser.parse_args()
    from multipod.pod_worker.devices import simulate_cpu_devices
    simulate_cpu_devices(1, overwrite=False)
    import jax
    import numpy as np

    from multipod.model import ModelConfig, init_params, layers, loss_sums

    with open(args.config, "rb") as f:
        model = ModelConfig(**tomllib.load(f)["model"])
    params = init_params(model, 0)
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(
        0, model.vocab_size, (args.batch, model.max_seq_len + 1)), dtype=jax.numpy.int32)

    def loss(p, t):
        ce, z = loss_sums(p, t, model)
        return ce + z

    transposed = jax.jit(jax.value_and_grad(loss))
    transposed_out = jax.block_until_ready(transposed(params, tokens))
    # The baseline is traced with the plain matmul in dense's place (SwiGLU looks it up when traced).
    kept = layers.dense
    layers.dense = lambda x, w: x @ w
    try:
        plain = jax.jit(jax.value_and_grad(loss))
        plain_out = jax.block_until_ready(plain(params, tokens))
    finally:
        layers.dense = kept
    grad_diff = max(float(abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(transposed_out[1]),
                                                             jax.tree_util.tree_leaves(plain_out[1])))

    times: dict[str, list[float]] = {"transposed": [], "plain": []}
    contenders = {"transposed": transposed, "plain": plain}
    for round_index in range(args.rounds):
        order = ["transposed", "plain"] if round_index % 2 == 0 else ["plain", "transposed"]
        for name in order:
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(contenders[name](params, tokens))
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(json.dumps({
        "command": "python -m bench.mlp_grad " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                    "processor": platform.processor() or platform.machine(), "jax": jax.__version__},
        "load": [round(x, 2) for x in os.getloadavg()],
        "tokens_per_call": args.batch * model.max_seq_len,
        "median_s": {name: round(value, 4) for name, value in medians.items()},
        "transposed_over_plain": round(medians["transposed"] / medians["plain"], 3),
        "loss_equal": bool(transposed_out[0] == plain_out[0]),
        "max_grad_difference": grad_diff,
    }, indent=1))


if __name__ == "__main__":
    main()
