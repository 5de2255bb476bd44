"""Measure the matmul throughput of this process's jax devices (`multipod peak-flops` runs this
in a fresh process: `python -m multipod.pod_worker.peak_probe DEVICES SIZE REPEATS`, one JSON line out).

A fresh process, because the simulated device count must be set before jax initialises.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from multipod.pod_worker.devices import simulate_cpu_devices


def measure_here(n: int, size: int, repeats: int) -> dict:
    """Median per-device FLOP/s of one independent size x size matmul per device (every device busy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()[:n]
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    a = jax.device_put(jnp.ones((n, size, size), jnp.float32), sharding)
    b = jax.device_put(jnp.ones((n, size, size), jnp.float32), sharding)
    f = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), out_shardings=sharding)
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    flops = 2 * size ** 3
    return {"devices": n, "device_kind": devices[0].device_kind, "size": size, "repeats": repeats,
            "median_s": median, "per_device_flops": flops / median, "total_flops": n * flops / median}


if __name__ == "__main__":
    n, size, repeats = (int(v) for v in sys.argv[1:4])
    if n > 1:
        simulate_cpu_devices(n)
    print(json.dumps(measure_here(n, size, repeats)))
