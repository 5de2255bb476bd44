"""What the e2e tests of a failed pod (test_failover.py, test_hosts.py) do to a live run: kill one
of its worker processes mid-run and let the run finish in degraded mode."""
from __future__ import annotations

import os
import pathlib
import signal
from collections.abc import Callable

from tests.e2e.test_recovery import _Live, _wait_for_step


def kill_and_finish(run: _Live, run_dir: pathlib.Path, pid: Callable[[], int], degraded: str,
                    step: int = 10, timeout: float = 400) -> int:
    """Once `run` has recorded `step`, SIGKILL the worker process pid() names (read then: a
    restarted worker's pid changes); wait for the progress line `degraded` (e.g. "degraded: 1/2
    pods"), then for the run's end, within `timeout` s. Returns its exit code; the run is killed
    if any of this fails."""
    try:
        _wait_for_step(run.proc, run_dir, step)
        os.kill(pid(), signal.SIGKILL)
        run.wait_for(degraded, 120)
        return run.finish(timeout)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
