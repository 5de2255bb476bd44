"""How a crashed test process ended, said in the run's output (a pytest-xdist hook).

xdist only says that a worker crashed and which test it was running. Whether the process was
killed (a signal: SIGKILL leaves no traceback at all), aborted (faulthandler has printed the
stacks then) or left through _exit (a library's quiet fatal error, whose message went to the
test's captured output and was lost with the process) is what tells those causes apart, so the
controller process waits for the dead worker and prints its exit status and pid, with the time.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

WAIT_S = 10.0     # a worker that xdist saw go down has exited, or is about to


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """Print `test process gwN (pid P) ended with signal S | exit code C at HH:MM:SS` for a
    worker that went down with an error (a clean shutdown passes error=None)."""
    if error is None:
        return
    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    if popen is None:        # not a local subprocess (xdist over ssh, a proxy): nothing to ask
        return
    try:
        code = popen.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        how = f"no exit within {WAIT_S:g}s"
    else:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    print(f"\ntest process {node.gateway.id} (pid {popen.pid}) ended with {how} at "
          f"{time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
