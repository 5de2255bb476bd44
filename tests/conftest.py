"""Test-wide setup, before any test module imports jax:

- simulate 4 CPU devices in the test process (worker subprocesses set their own count);
- one persistent JAX compilation cache for every test session on this machine, in this process
  and in every process a test starts (they inherit the environment; `multipod local` keeps a
  cache it is given): a program compiled once, in any test, is loaded by every later test that
  compiles the same program, in this session or a later one, as a user's later runs load what an
  earlier one compiled (pod_worker/compile_cache.py). So a fresh machine (CI) compiles each of the
  suite's programs once, and a later session on it compiles only the programs a change touched
  (jax finds a program again only for the same HLO, compile options, XLA flags and jax and XLA
  versions). For a cold session, name an empty cache: JAX_COMPILATION_CACHE_DIR=$(mktemp -d).
  It is bounded as the machine's cache is (jax drops the programs read least recently), and so
  jax locks it around each read and write;
- the processes tests start may write Python's bytecode cache (__pycache__, ignored by git):
  where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does), every worker and
  controller would compile this package's sources again at each start, about 0.1 s of CPU per
  process over the suite's hundreds;
- a test process that crashes is named with how it ended (tests/crash_report.py);
- the cyclic garbage collector's thresholds of every `multipod` process (cli.py), and its one
  OpenBLAS thread (set before anything here imports numpy; the processes tests start inherit it).
"""
import gc
import os

# As cli.entry does for every `multipod` process: before numpy is imported (pytest and its plugins
# do not import it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from multipod.cli import GC_THRESHOLDS  # noqa: E402
from multipod.pod_worker.compile_cache import COMPILE_CACHE_MAX_BYTES, remove_orphans  # noqa: E402
from multipod.pod_worker.devices import simulate_cpu_devices  # noqa: E402
from multipod.pod_worker.schema.caches import COMPILED  # noqa: E402
from tests.helpers import TEST_CACHE_ROOT  # noqa: E402

pytest_plugins = ["tests.crash_report"]

simulate_cpu_devices(4, overwrite=False)

# The collector's thresholds every `multipod` process runs with (cli.py): the unit tests trace
# and compile in this process as a worker does, and spent as much of their time in its passes
# (docs/benchmarks.md, "Thirty-seventh session").
gc.set_threshold(*GC_THRESHOLDS)

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The machine cache's place under the tests' cache root, unless the environment names a cache.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(TEST_CACHE_ROOT / COMPILED))
# Every program, however quick to compile: the tiny test models compile in well under the
# default 1 s threshold, and there are hundreds of them.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Bounded, as the machine's cache of `multipod local` is (pod_worker/compile_cache.py): only a
# bounded cache makes jax lock the folder around each read and write. Unbounded, a process could
# read a program another was still writing ("ZstdError: error determining content size from
# frame header", seen once in a pass), and compile it again.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(COMPILE_CACHE_MAX_BYTES))
# What a process killed mid-write left in it (a kill test's worker, an interrupted session) would
# stop jax writing to it for this session and every later one; each worker removes it at its start
# too (pod_worker/compile_cache.py).
remove_orphans(os.environ)
