"""The controller's test hooks read from the environment (controller/core/fault_hooks.py):
MULTIPOD_TEST_HOLD's step holds."""
from __future__ import annotations

import threading

import pytest

from multipod.controller.core import fault_hooks


def test_a_hold_drains_marks_and_waits_for_the_go_once_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv(fault_hooks.HOLD_ENV, f"3,5:{tmp_path}")
    hold = fault_hooks.StepHold()
    drained = []
    assert not hold.at(2, lambda: drained.append(2))            # not asked: no drain, no wait
    released = threading.Timer(0.3, (tmp_path / "go-3").touch)
    released.start()
    try:
        assert hold.at(3, lambda: drained.append(3))
    finally:
        released.cancel()
    assert (tmp_path / "held-3").exists() and (tmp_path / "go-3").exists() and drained == [3]
    assert not hold.at(3, lambda: drained.append(33))           # each step holds once
    assert drained == [3] and not (tmp_path / "held-5").exists()


def test_without_the_hook_nothing_holds(monkeypatch):
    monkeypatch.delenv(fault_hooks.HOLD_ENV, raising=False)
    hold = fault_hooks.StepHold()
    assert not hold.at(0, lambda: pytest.fail("drained without a hold"))


@pytest.mark.parametrize("value", ["3", "x:/tmp", "3:", "3,a:/tmp"])
def test_a_malformed_hold_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(fault_hooks.HOLD_ENV, value)
    with pytest.raises(ValueError, match=fault_hooks.HOLD_ENV):
        fault_hooks.StepHold()


def test_a_hold_whose_drain_fails_stays_for_the_step_s_retry(tmp_path, monkeypatch):
    # The steps in flight fail while the loop drains them (a pod died): the run recovers and comes
    # back to the step, and the test's hold must still be there.
    monkeypatch.setenv(fault_hooks.HOLD_ENV, f"4:{tmp_path}")
    hold = fault_hooks.StepHold()

    def failing_drain():
        raise RuntimeError("pod 1 died")
    with pytest.raises(RuntimeError):
        hold.at(4, failing_drain)
    assert not (tmp_path / "held-4").exists()
    (tmp_path / "go-4").touch()
    assert hold.at(4, lambda: None) and (tmp_path / "held-4").exists()
