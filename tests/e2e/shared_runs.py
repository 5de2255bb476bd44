"""Reference runs shared by every test module of a session, whichever test process runs them.

Under pytest-xdist each test process has its own module and session fixtures, so a reference run
that two modules compare against would run twice. `shared_run` runs it once for the whole
session: the first test process to ask runs it under a file lock in the session's base temporary
directory, the others wait for the lock (within a deadline) and read the same run directory.
A failed run is remembered with its output, so every test that needs it fails with the reason.
"""
from __future__ import annotations

import os
import pathlib
from typing import NamedTuple

from multipod.controller.core.run_lock import lock_within
from tests.e2e.test_recovery import _run

WAIT_S = 900.0      # a 2-host run on a loaded machine takes minutes; a hang must still end


def _session_dir(tmp_path_factory) -> pathlib.Path:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each test process has its own base (…/pytest-N/popen-gwK); their parent is the
    # session's. Without xdist the base is the session's own.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class SharedRun(NamedTuple):
    run_dir: pathlib.Path
    stdout: str
    stderr: str


def shared_run(tmp_path_factory, name: str, *args: str, env: dict) -> SharedRun:
    """`multipod *args --run-dir DIR`, run once per session under `name` (the same name must
    always mean the same arguments): its directory and what it printed. AssertionError with the
    run's output if it failed."""
    folder = _session_dir(tmp_path_factory) / "shared-runs"
    folder.mkdir(exist_ok=True)
    run_dir, failed = folder / name, folder / f"{name}.failed"
    with open(folder / f"{name}.lock", "w") as lock:
        if not lock_within(lock, WAIT_S, 0.5):
            raise TimeoutError(f"the shared run {name!r} was not done within {WAIT_S:g}s")
        if failed.exists():
            raise AssertionError(f"the shared run {name!r} failed:\n{failed.read_text()}")
        out, err = folder / f"{name}.stdout", folder / f"{name}.stderr"
        if not out.exists():
            result = _run(*args, "--run-dir", str(run_dir), env=env)
            if result.returncode != 0:
                failed.write_text(result.stdout + result.stderr)
                raise AssertionError(f"the shared run {name!r} failed:\n{result.stdout + result.stderr}")
            err.write_text(result.stderr)
            out.write_text(result.stdout)     # last: its presence says the run is complete
        return SharedRun(run_dir, out.read_text(), err.read_text())
