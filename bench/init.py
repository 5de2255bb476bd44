"""What the parameter init costs a worker's start, by depth: a fresh process initialises a model's
parameters in their layout (2 simulated devices), once with an empty compilation cache (cold:
tracing, compiling, running) and once more with that cache (warm: tracing, loading, running).
Prints one JSON object.

    python -m bench.init [--layers 2,8,16] [--repeats 3]

The model is configs/tiny.toml's widened to d_model 64 with the layers asked for; the CPU seconds
are the child's own (getrusage around init_params alone, after its imports and the shapes'
tracing, which every worker does either way). Medians over --repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import os, resource, sys, time
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from multipod.model import ModelConfig, abstract_params, init_params, partitioning
config = ModelConfig(vocab_size=256, d_model=64, n_layers=int(sys.argv[1]), n_heads=4, n_kv_heads=1, head_dim=16,
                     mlp_dim=256, max_seq_len=64)
shardings = partitioning.param_shardings(abstract_params(config), partitioning.make_mesh(2, 1))
before = resource.getrusage(resource.RUSAGE_SELF)
jax.block_until_ready(init_params(config, 0, shardings=shardings))
after = resource.getrusage(resource.RUSAGE_SELF)
print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""


def one(layers: int, cache: str) -> float:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(layers), cache], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the init of {layers} layers failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8,16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    depths = [int(n) for n in args.layers.split(",")]
    results = {}
    for layers in depths:
        cold, warm = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:
                cold.append(one(layers, cache))
                warm.append(one(layers, cache))
        results[str(layers)] = {"cold_cpu_s": round(statistics.median(cold), 3),
                                "warm_cpu_s": round(statistics.median(warm), 3)}
    print(json.dumps({"benchmark": "init", "repeats": args.repeats, "machine": f"{os.cpu_count()} cores",
                      "load_average_after": os.getloadavg(), "layers": results}, indent=1))


if __name__ == "__main__":
    main()
