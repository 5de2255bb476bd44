"""controller/core/exit_deadline.py: a process whose teardown blocks after its command returned
leaves by the deadline, with the command's exit code and every thread's stack on stderr."""
import subprocess
import sys

_BLOCKED_TEARDOWN = """
import atexit, threading
from multipod.controller.core.exit_deadline import arm
atexit.register(lambda: threading.Event().wait(600))    # a library's teardown that never returns
arm(130, seconds=1.0)
raise SystemExit(130)
"""


def test_a_blocked_teardown_ends_at_the_deadline_with_the_command_s_exit_code():
    done = subprocess.run([sys.executable, "-c", _BLOCKED_TEARDOWN], capture_output=True, text=True,
                          timeout=60)     # the handler waits 600 s: only the deadline ends it sooner
    assert done.returncode == 130, done.stderr
    assert "exit did not finish within 1s" in done.stderr and "leaving with exit code 130" in done.stderr
    assert "in <lambda>" in done.stderr        # the blocked handler's stack, to trace the hang


def test_a_quick_exit_is_left_alone():
    done = subprocess.run([sys.executable, "-c", "from multipod.controller.core.exit_deadline import arm\n"
                           "arm(3, seconds=30.0)\nraise SystemExit(0)"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "exit did not finish" not in done.stderr


_ENTRY_WITH_BLOCKED_TEARDOWN = """
import atexit, sys, threading
import multipod.controller.core.exit_deadline as exit_deadline
exit_deadline.EXIT_DEADLINE_S = 1.0
atexit.register(lambda: threading.Event().wait(600))
sys.argv = ["multipod", "cache", "list", "--cache-dir", sys.argv[1]]
from multipod.cli import entry
entry()
"""


def test_the_process_entry_arms_the_deadline(tmp_path):
    done = subprocess.run([sys.executable, "-c", _ENTRY_WITH_BLOCKED_TEARDOWN, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr      # `cache list` succeeded; the deadline kept its code
    assert "exit did not finish within 1s" in done.stderr


def test_main_run_in_process_leaves_the_caller_s_process_alone(tmp_path):
    """A test or notebook calling `main` must not have its own process ended 20 s later."""
    import threading

    from multipod.cli import main
    assert main(["cache", "list", "--cache-dir", str(tmp_path)]) == 0
    assert "exit-deadline" not in {thread.name for thread in threading.enumerate()}
