"""Test-wide setup: simulate 4 CPU devices in the test process.

XLA reads the flag when jax initialises its backend, so it must be set before any test module
imports jax. Worker subprocesses started by tests set their own device count.
"""
from multipod.pod_worker.devices import simulate_cpu_devices

simulate_cpu_devices(4, overwrite=False)
