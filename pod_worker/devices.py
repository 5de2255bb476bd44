"""How a process is made to see N simulated CPU devices: the one place that knows the XLA flag.

Must run before jax initialises its backend, so this module imports nothing heavy. Every process
that simulates a pod's devices (a worker, a tune probe, a peak measurement, the test process)
calls simulate_cpu_devices first.
"""
from __future__ import annotations

import os
import re

_FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(n: int, environ: dict | None = None, overwrite: bool = True) -> None:
    """Make jax (not yet initialised) in this process see n CPU devices. `environ` defaults to
    os.environ; overwrite=False leaves a device count that is already set alone."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if not overwrite and _FLAG in flags:
        return
    flags = re.sub(rf"{_FLAG}=\d+", "", flags)
    env["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
