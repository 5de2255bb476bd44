"""How a crashed test process ended, said in the run's output (a pytest-xdist hook).

xdist only says that a worker crashed and which test it was running. Whether the process was
killed (a signal: SIGKILL leaves no traceback at all), aborted (faulthandler has printed the
stacks then) or left through _exit (a library's quiet fatal error, whose message went to the
test's captured output and was lost with the process) is what tells those causes apart, so the
controller process waits for the dead worker and prints its exit status and pid, with the time.

A crash can also land while xdist's controller is sending the dead worker its next tests: the
send fails, xdist ends the run with an INTERNALERROR (exit code 3) and never reports the crash.
On an internal error this module names every test process that has exited, how, and the test it
had not finished (read from xdist's scheduler, where it keeps each worker's tests).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

WAIT_S = 10.0     # a worker that xdist saw go down has exited, or is about to
_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


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
        how = _how(code)
    print(f"\ntest process {node.gateway.id} (pid {popen.pid}) ended with {how} at "
          f"{time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def pytest_internalerror(excrepr, excinfo) -> None:
    """After an internal error of the run: `test process gwN (pid P) ended with ... while running
    TEST` for every test process that has exited (xdist's controller only; nothing otherwise)."""
    dsession = _config.pluginmanager.getplugin("dsession") if _config is not None else None
    scheduler = getattr(dsession, "sched", None)
    work = getattr(scheduler, "assigned_work", None) or {}     # loadscope and loadfile keep it
    for node in getattr(scheduler, "nodes", []):
        popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
        code = None if popen is None else popen.poll()
        if code is None:
            continue
        unfinished = [nodeid for unit in work.get(node, {}).values() for nodeid, done in unit.items() if not done]
        running = f" while running {unfinished[0]!r}" if unfinished else ""
        print(f"\ntest process {node.gateway.id} (pid {popen.pid}) ended with {_how(code)}{running}",
              file=sys.stderr, flush=True)
