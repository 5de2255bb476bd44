"""`multipod peak-flops`: measure the matmul throughput of this machine's jax devices.

Runs in a subprocess (multipod.pod_worker.peak) so the simulated device count can be chosen. The
result (per-device FLOP/s) is stored for `multipod train` to use as the MFU denominator when
`--peak-flops` is not given. For simulated pods on one machine, measure with --devices equal to
the total simulated devices (pods x devices per pod): they share the same cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def measure(devices: int, size: int = 1024, repeats: int = 7, timeout_s: float = 600) -> dict:
    """Median per-device matmul FLOP/s over `repeats` runs, measured in a fresh process."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)   # the measuring process sets its own device count
    result = subprocess.run([sys.executable, "-m", "multipod.pod_worker.peak", str(devices), str(size), str(repeats)],
                            env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"peak measurement failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
