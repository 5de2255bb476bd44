"""`multipod peak-flops`: measure the matmul throughput of this machine's jax devices.

Runs in a subprocess so the simulated device count can be chosen. The result (per-device FLOP/s)
is stored for `multipod train` to use as the MFU denominator when `--peak-flops` is not given.
For simulated pods on one machine, measure with --devices equal to the total simulated devices
(pods x devices per pod): they share the same cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

_MEASURE = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n, size, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
devices = jax.devices()[:n]
mesh = Mesh(np.array(devices), ("d",))
# One independent matmul per device (a batch of n, split over the devices): every device busy.
sharding = NamedSharding(mesh, P("d"))
a = jax.device_put(jnp.ones((n, size, size), jnp.float32), sharding)
b = jax.device_put(jnp.ones((n, size, size), jnp.float32), sharding)
f = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), out_shardings=sharding)
f(a, b).block_until_ready()
times = []
for _ in range(repeats):
    t = time.perf_counter(); f(a, b).block_until_ready(); times.append(time.perf_counter() - t)
median = statistics.median(times)
flops = 2 * size ** 3
print(json.dumps({"devices": n, "device_kind": devices[0].device_kind, "size": size, "repeats": repeats,
                  "median_s": median, "per_device_flops": flops / median,
                  "total_flops": n * flops / median}))
"""


def measure(devices: int, size: int = 1024, repeats: int = 7, timeout_s: float = 600) -> dict:
    """Median per-device matmul FLOP/s over `repeats` runs, measured in a fresh process."""
    env = dict(os.environ)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(devices), str(size), str(repeats)],
                            env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"peak measurement failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
