"""Fault injection for tests, outside the production config: the controller reads it from its
environment here and nowhere else, and it is never part of the config.

MULTIPOD_TEST_SPIKE_BATCH=N makes the controller record a 1000x loss for the step that trains on
batch N (a "bad batch": a rewind that skips batches does not meet it again), so tests can exercise
the loss-spike policy.

MULTIPOD_TEST_REJOIN_BY_STEP=N makes degraded mode wait, at every step boundary from step N on,
for each failed pod on its way back to be ready to rejoin (within recovery.restart_timeout_s), instead
of training on without it. A test of a rejoin then waits for the event it checks rather than
hoping the run is long enough for a restarted worker to come back on a loaded machine.
"""
from __future__ import annotations

import os

SPIKE_BATCH_ENV = "MULTIPOD_TEST_SPIKE_BATCH"
SPIKE_FACTOR = 1000.0
REJOIN_BY_STEP_ENV = "MULTIPOD_TEST_REJOIN_BY_STEP"


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
