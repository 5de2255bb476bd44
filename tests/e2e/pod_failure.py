"""What the e2e tests of a failed pod (test_failover.py, test_hosts.py) do to a live run: kill one
of its worker processes mid-run and let the run finish in degraded mode.

With a hold (held_env: the controller's MULTIPOD_TEST_HOLD hook, controller/core/fault_hooks.py)
the kill lands at the step boundary the test names, while the controller waits: it cannot land
after the run has ended, however slow the machine or fast the run."""
from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Callable

from tests.e2e.test_recovery import _Live, _wait_for_step


def held_env(env: dict, folder: pathlib.Path, *steps: int) -> dict:
    """`env` with the controller asked to hold before each of `steps` (once each), its markers in
    `folder` (made here)."""
    folder.mkdir(parents=True, exist_ok=True)
    return dict(env, MULTIPOD_TEST_HOLD=f"{','.join(str(s) for s in steps)}:{folder}")


def wait_held(run: _Live, folder: pathlib.Path, step: int, timeout: float = 400) -> None:
    """Wait until the controller holds before `step` (every step before it finished and recorded)."""
    deadline = time.monotonic() + timeout
    while not (folder / f"held-{step}").exists():
        assert run.proc.poll() is None, f"the run ended before holding at step {step}: " + "".join(run.err)[-3000:]
        assert time.monotonic() < deadline, f"no hold at step {step} within {timeout}s"
        time.sleep(0.05)


def release(folder: pathlib.Path, step: int) -> None:
    """Let the controller go on from its hold before `step`."""
    (folder / f"go-{step}").touch()


def kill_and_finish(run: _Live, run_dir: pathlib.Path, pid: Callable[[], int], degraded: str,
                    step: int = 10, timeout: float = 400, hold: pathlib.Path | None = None) -> int:
    """Once `run` has recorded `step`, SIGKILL the worker process pid() names (read then: a
    restarted worker's pid changes); wait for the progress line `degraded` (e.g. "degraded: 1/2
    pods"), then for the run's end, within `timeout` s. With `hold` (the folder given to held_env,
    which must hold at step + 1) the kill lands while the controller holds there. Returns its exit
    code; the run is killed if any of this fails."""
    try:
        if hold is None:
            _wait_for_step(run.proc, run_dir, step)
            os.kill(pid(), signal.SIGKILL)
        else:
            wait_held(run, hold, step + 1)
            os.kill(pid(), signal.SIGKILL)
            release(hold, step + 1)
        run.wait_for(degraded, 120)
        return run.finish(timeout)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
