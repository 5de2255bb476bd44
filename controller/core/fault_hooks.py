"""Fault injection for tests, outside the production config: the controller reads it from its
environment here and nowhere else, and it is never part of the config.

MULTIPOD_TEST_SPIKE_BATCH=N makes the controller record a 1000x loss for the step that trains on
batch N (a "bad batch": a rewind that skips batches does not meet it again), so tests can exercise
the loss-spike policy.
"""
from __future__ import annotations

import os

SPIKE_BATCH_ENV = "MULTIPOD_TEST_SPIKE_BATCH"
SPIKE_FACTOR = 1000.0


def spike_batch() -> int | None:
    """The batch whose loss the test hook inflates, or None."""
    value = os.environ.get(SPIKE_BATCH_ENV, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SPIKE_BATCH_ENV} must be a batch index, got {value!r}") from None
