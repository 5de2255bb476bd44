"""cli.py: what the `multipod` process entry sets up for the whole process, and what it leaves
alone when another program calls `main` in its own process."""
import gc
import subprocess
import sys

from multipod.cli import GC_THRESHOLDS, main

# The process entry, as the `multipod` script runs it, on a command that imports no jax; at exit
# it prints the collector's thresholds the command ran with.
_ENTRY = """
import atexit, gc, sys
atexit.register(lambda: print("thresholds", *gc.get_threshold()))
sys.argv = ["multipod", "cache", "list", "--cache-dir", sys.argv[1]]
from multipod.cli import entry
entry()
"""


def test_the_process_entry_runs_the_command_with_the_collector_s_thresholds(tmp_path):
    done = subprocess.run([sys.executable, "-c", _ENTRY, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == ["thresholds", *map(str, GC_THRESHOLDS)]
    assert GC_THRESHOLDS != (700, 10, 10)    # Python 3.11's defaults: the setting changes something


def test_main_run_in_process_leaves_the_caller_s_collector_alone(tmp_path):
    before = gc.get_threshold()
    callers = (701, 11, 12)     # neither Python's defaults nor GC_THRESHOLDS
    gc.set_threshold(*callers)
    try:
        assert main(["cache", "list", "--cache-dir", str(tmp_path)]) == 0
        assert gc.get_threshold() == callers
    finally:
        gc.set_threshold(*before)
