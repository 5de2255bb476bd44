"""The controller's hold on its run directory: one controller per run at a time.

Two controllers on one run directory (a second `--resume` while the first still runs, say) would
write the same checkpoints, metrics and events over each other. The controller holds an
exclusive flock on RUN_DIR/.controller.lock for the whole run; the kernel drops it when the
process ends however it ends (kill -9 included), so a dead controller never blocks a restarted
one. Other commands ask the same lock whether a controller runs the directory now
(`multipod attach`)."""
from __future__ import annotations

import fcntl
import os
import pathlib
import time

from multipod.controller.core.run_config import ConfigError

LOCK_FILE = ".controller.lock"
# How long a starting controller retries a lock it finds held: running_controller holds it shared
# for microseconds, and must never make a controller refuse to start.
SHARED_HOLD_S = 1.0


def lock_within(handle, timeout_s: float, poll_s: float) -> bool:
    """Take an exclusive flock on open file `handle`, trying every poll_s for up to timeout_s;
    whether it was taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)


class RunDirLock:
    """Held while a controller runs `run_dir` (a context manager). Entering raises ConfigError
    naming the other controller's pid if one holds it."""

    def __init__(self, run_dir: pathlib.Path):
        self.path = pathlib.Path(run_dir) / LOCK_FILE
        self._file = None

    def __enter__(self) -> RunDirLock:
        handle = self.path.open("a+")
        # Retried a moment: perhaps only running_controller's brief look holds it.
        if not lock_within(handle, SHARED_HOLD_S, 0.05):
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise ConfigError("--run-dir", f"{self.path.parent} is being run by another controller now (pid "
                                           f"{holder}): wait for it to end, or give another --run-dir")
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()      # and with it the lock
            self._file = None


def running_controller(run_dir: pathlib.Path) -> int | None:
    """The pid of the controller running `run_dir` now, or None if none does."""
    path = pathlib.Path(run_dir) / LOCK_FILE
    try:
        handle = path.open("r")
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = handle.read().strip()
            return int(text) if text.isdigit() else -1
        return None
