"""The loss-spike policy."""
from __future__ import annotations

import math

from multipod.controller.components.spike import Spike, SpikePolicy
from multipod.controller.core import fault_hooks as faults
from multipod.controller.core.run_config import SpikeConfig
from tests.unit.controller.fakes import a_step_record


def _record(step, loss, skipped=False, data_index=None):
    return a_step_record(step, loss, skipped=skipped, data_index=step if data_index is None else data_index)


def _policy(**fields):
    return SpikePolicy(SpikeConfig(**{"policy": "rewind", "window": 3, "threshold": 3.0, **fields}))


def test_nothing_is_judged_until_the_window_is_full():
    policy = _policy()
    assert policy.check(_record(0, 1.0)) is None
    assert policy.check(_record(1, 100.0)) is None      # a window of 2: not judged yet
    assert policy.check(_record(2, 1.0)) is None


def test_a_loss_above_threshold_times_the_mean_is_a_spike():
    policy = _policy()
    for step in range(3):
        policy.check(_record(step, 2.0))
    assert policy.check(_record(3, 5.9)) is None          # below 3 x 2.0
    spike = policy.check(_record(4, 100.0))
    assert isinstance(spike, Spike) and spike.step == 4 and spike.loss == 100.0
    assert math.isclose(spike.mean, (2.0 + 2.0 + 5.9) / 3)
    assert policy.check(_record(5, 100.0)) is not None    # the spike did not enter the window


def test_skipped_and_non_finite_steps_are_ignored():
    policy = _policy()
    for step in range(3):
        policy.check(_record(step, 2.0))
    assert policy.check(_record(3, math.nan)) is None
    assert policy.check(_record(4, math.inf)) is None
    assert policy.check(_record(5, 100.0, skipped=True)) is None
    assert list(policy.losses) == [2.0, 2.0, 2.0]


def test_a_restore_rebuilds_the_window_the_uninterrupted_run_has_at_that_step():
    policy = _policy()
    for step, loss in enumerate([1.0, 2.0, 2.0, 2.0, 9.0]):
        policy.check(_record(step, loss))
    # Restored to step 3 (after a pod failure): steps 3 and 4 are abandoned, and the window is the
    # losses of steps 0-2, as the uninterrupted run had it before its step 3.
    policy.restart_at(3)
    assert list(policy.losses) == [1.0, 2.0, 2.0]
    spike = policy.check(_record(3, 100.0))
    assert isinstance(spike, Spike) and math.isclose(spike.mean, 5.0 / 3)
    # Back to the start: nothing before it, nothing judged until the window fills again.
    policy.restart_at(0)
    assert list(policy.losses) == [] and policy.check(_record(0, 100.0)) is None


def test_without_rewind_no_spike_is_reported():
    policy = _policy(policy="none")
    for step in range(3):
        policy.check(_record(step, 2.0))
    assert policy.check(_record(3, 100.0)) is None


def test_the_test_hook_inflates_the_loss_of_its_batch_only(monkeypatch):
    monkeypatch.setenv(faults.SPIKE_BATCH_ENV, "5")
    policy = _policy()
    for step in range(3):
        policy.check(_record(step, 2.0))
    record = policy.with_test_spike(_record(3, 2.0, data_index=5))
    assert record.loss == 2.0 * faults.SPIKE_FACTOR and policy.check(record) is not None
    other = _record(5, 2.0, data_index=7)
    assert policy.with_test_spike(other) is other and policy.check(other) is None
