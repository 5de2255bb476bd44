"""Test-wide setup, before any test module imports jax:

- simulate 4 CPU devices in the test process (worker subprocesses set their own count);
- one persistent JAX compilation cache for the whole test session, in this process and in every
  process a test starts (they inherit the environment; `multipod local` keeps a cache it is
  given): a program compiled once, in any test, is loaded by every later test that compiles the
  same program. It starts empty each session, so no test depends on an earlier session, and it is
  bounded as the machine's cache is, so that jax locks it around each read and write;
- the processes tests start may write Python's bytecode cache (__pycache__, ignored by git):
  where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does), every worker and
  controller would compile this package's sources again at each start, about 0.1 s of CPU per
  process over the suite's hundreds;
- a test process that crashes is named with how it ended (tests/crash_report.py).
"""
import atexit
import os
import shutil
import tempfile

from multipod.pod_worker.compile_cache import COMPILE_CACHE_MAX_BYTES
from multipod.pod_worker.devices import simulate_cpu_devices

pytest_plugins = ["tests.crash_report"]

simulate_cpu_devices(4, overwrite=False)

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="multipod-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every program, however quick to compile: the tiny test models compile in well under the
    # default 1 s threshold, and there are hundreds of them.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    # Bounded, as the machine's cache of `multipod local` is (pod_worker/compile_cache.py): only a
    # bounded cache makes jax lock the folder around each read and write. Unbounded, a process
    # could read a program another was still writing ("ZstdError: error determining content size
    # from frame header", seen once in a pass), and compile it again.
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(COMPILE_CACHE_MAX_BYTES)
