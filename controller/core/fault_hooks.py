"""Fault injection for tests, outside the production config: the controller reads it from its
environment here and nowhere else, and it is never part of the config.

MULTIPOD_TEST_SPIKE_BATCH=N makes the controller record a 1000x loss for the step that trains on
batch N (a "bad batch": a rewind that skips batches does not meet it again), so tests can exercise
the loss-spike policy.

MULTIPOD_TEST_REJOIN_BY_STEP=N makes degraded mode wait, at every step boundary from step N on,
for each failed pod on its way back to be ready to rejoin (within recovery.restart_timeout_s), instead
of training on without it. A test of a rejoin then waits for the event it checks rather than
hoping the run is long enough for a restarted worker to come back on a loaded machine.

MULTIPOD_TEST_HOLD="S1,S2,...:DIR" makes the step loop, at the boundary before step S (the first
time this controller reaches it), finish the steps in flight, create DIR/held-S and wait for
DIR/go-S (at most HOLD_TIMEOUT_S, then it goes on) before it dispatches S. A test acts on the run
(kills or stops a worker) at a step of its choosing, whatever the machine's speed, instead of
racing a run that may end first.
"""
from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable

SPIKE_BATCH_ENV = "MULTIPOD_TEST_SPIKE_BATCH"
SPIKE_FACTOR = 1000.0
REJOIN_BY_STEP_ENV = "MULTIPOD_TEST_REJOIN_BY_STEP"
HOLD_ENV = "MULTIPOD_TEST_HOLD"
HOLD_TIMEOUT_S = 300.0


def _int_env(name: str, what: str) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


def spike_batch() -> int | None:
    """The batch whose loss the test hook inflates, or None."""
    return _int_env(SPIKE_BATCH_ENV, "a batch index")


def rejoin_by_step() -> int | None:
    """The step from which degraded mode waits for failed pods to rejoin, or None."""
    return _int_env(REJOIN_BY_STEP_ENV, "a step")


class StepHold:
    """MULTIPOD_TEST_HOLD's holds (none where it is unset), each once per controller process."""

    def __init__(self) -> None:
        value = os.environ.get(HOLD_ENV, "")
        self.steps: set[int] = set()
        self.folder: pathlib.Path | None = None
        if value:
            steps, sep, folder = value.partition(":")
            try:
                self.steps = {int(step) for step in steps.split(",")}
            except ValueError:
                raise ValueError(f"{HOLD_ENV} must look like S1,S2,...:DIR, got {value!r}") from None
            if not sep or not folder:
                raise ValueError(f"{HOLD_ENV} must look like S1,S2,...:DIR, got {value!r}")
            self.folder = pathlib.Path(folder)

    def at(self, step: int, drain: Callable[[], None]) -> bool:
        """Hold before `step` if asked (see the module docstring); whether it held."""
        if step not in self.steps or self.folder is None:
            return False
        drain()     # a step in flight that fails raises here, and the hold stays for the step's retry
        self.steps.discard(step)
        (self.folder / f"held-{step}").touch()
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not (self.folder / f"go-{step}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return True
