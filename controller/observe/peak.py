"""The MFU denominator: this machine's per-device matmul peak, measured once and cached.

`multipod peak-flops` measures it on demand; the first `multipod local` run on a machine measures
it by itself (resolve_peak) unless --peak-flops is given or --no-peak is set. The measurement
runs in a subprocess (multipod.pod_worker.peak_probe) so the simulated device count can be chosen: for
simulated pods on one machine it is the total simulated devices (pods x devices per pod), which
share the same cores. The result (per-device FLOP/s) is cached per (device kind, device count).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from multipod.controller.observe.metrics import load_measured_peak, out, peak_cache, store_measured_peak


def measure(devices: int, size: int = 1024, repeats: int = 7, timeout_s: float = 600) -> dict:
    """Median per-device matmul FLOP/s over `repeats` runs, measured in a fresh process."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)   # the measuring process sets its own device count
    argv = [sys.executable, "-m", "multipod.pod_worker.peak_probe", str(devices), str(size), str(repeats)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"peak measurement failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def resolve_peak(run, device_kind: str, num_devices: int, local: bool) -> float | None:
    """Per-device peak FLOP/s for MFU: run.peak_flops if given, else the cached measurement for
    these devices, else (pods on this machine, run.measure_peak) a fresh measurement, cached;
    None if unknown (a failed measurement is a warning, never the run's failure)."""
    if run.peak_flops:
        return run.peak_flops
    cached = load_measured_peak(device_kind, num_devices)
    if cached or not (local and run.measure_peak):
        return cached
    out(f"measuring this machine's peak FLOP/s for MFU ({num_devices} {device_kind} device(s); once, cached in "
        f"{peak_cache()}; --peak-flops or --no-peak skip it)")
    try:
        result = measure(num_devices, timeout_s=120)
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
        out(f"warning: peak measurement failed, MFU not reported: {str(exc).strip()[-300:]}")
        return None
    store_measured_peak(result["device_kind"], result["devices"], result["per_device_flops"])
    return float(result["per_device_flops"])
