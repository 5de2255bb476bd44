"""cli.py: what the `multipod` process entry sets up for the whole process, and what it leaves
alone when another program calls `main` in its own process."""
import gc
import os
import subprocess
import sys

from multipod.cli import GC_THRESHOLDS, main

# The process entry, as the `multipod` script runs it, on a command that imports no jax; at exit
# it prints the collector's thresholds and the OpenBLAS thread count the command ran with.
_ENTRY = """
import atexit, gc, os, sys
atexit.register(lambda: print("thresholds", *gc.get_threshold()))
atexit.register(lambda: print("openblas", os.environ.get("OPENBLAS_NUM_THREADS")))
sys.argv = ["multipod", "cache", "list", "--cache-dir", sys.argv[1]]
from multipod.cli import entry
entry()
"""


def _entry(tmp_path, **env: str) -> list[str]:
    """The last lines the process entry's run printed (atexit runs last-registered first)."""
    environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", _ENTRY, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=dict(environ, **env))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-2:]


def test_the_process_entry_runs_the_command_with_the_collector_s_thresholds_and_one_blas_thread(tmp_path):
    openblas, thresholds = _entry(tmp_path)
    assert thresholds.split() == ["thresholds", *map(str, GC_THRESHOLDS)]
    assert GC_THRESHOLDS != (700, 10, 10)    # Python 3.11's defaults: the setting changes something
    assert openblas == "openblas 1"


def test_a_user_s_own_blas_thread_count_stands(tmp_path):
    openblas, _ = _entry(tmp_path, OPENBLAS_NUM_THREADS="2")
    assert openblas == "openblas 2"


def test_main_run_in_process_leaves_the_caller_s_collector_alone(tmp_path):
    before = gc.get_threshold()
    callers = (701, 11, 12)     # neither Python's defaults nor GC_THRESHOLDS
    gc.set_threshold(*callers)
    try:
        assert main(["cache", "list", "--cache-dir", str(tmp_path)]) == 0
        assert gc.get_threshold() == callers
    finally:
        gc.set_threshold(*before)
