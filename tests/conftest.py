"""Test-wide setup: simulate 4 CPU devices in the test process.

XLA reads the flag when jax initialises its backend, so it must be set before any test module
imports jax. Worker subprocesses started by tests set their own device count.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
