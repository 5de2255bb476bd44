"""The step sequencer on its own (no jax, no gRPC): the order steps run in, and every exit of a
waiting step, each within its deadline."""
from __future__ import annotations

import threading
import time

import pytest

from multipod.pod_worker.errors import AlreadyDone, Busy, Cancelled, StepAborted
from multipod.pod_worker.sequencer import Sequencer
from multipod.protos import multipod_pb2 as pb

POLL_S = 0.02


def _ready(step: int = 0) -> Sequencer:
    seq = Sequencer("pod 0", poll_s=POLL_S)
    with seq.hold("a configure", deadline=0.0, state=pb.WORKER_STATE_CONFIGURING):
        seq.reset(step, "reconfigured")
    return seq


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def _run(seq: Sequencer, step: int, ok: bool = True) -> None:
    seq.begin_step(step, seq.epoch, _soon())
    seq.finish_step(step, step + 1 if ok else step, ok)


class Waiter:
    """begin_step on a thread; records when it got the pod, or the error it ended with."""

    def __init__(self, seq: Sequencer, step: int, deadline_s: float = 5.0, epoch: int | None = None,
                 is_active=lambda: True):
        self.seq, self.step, self.error, self.started = seq, step, None, threading.Event()
        epoch = seq.epoch if epoch is None else epoch
        self.thread = threading.Thread(target=self._wait, args=(epoch, _soon(deadline_s), is_active))
        self.thread.start()

    def _wait(self, epoch, deadline, is_active):
        try:
            self.seq.begin_step(self.step, epoch, deadline, is_active)
            self.started.set()
        except Exception as exc:  # recorded for the test to check
            self.error = exc

    def join(self) -> Waiter:
        self.thread.join(10)
        assert not self.thread.is_alive(), "a waiting step hung"
        return self


def test_states_from_idle_through_configure_to_ready():
    seq = Sequencer("pod 0", poll_s=POLL_S)
    assert seq.state == pb.WORKER_STATE_IDLE
    seen = []
    with seq.hold("a configure", deadline=0.0, state=pb.WORKER_STATE_CONFIGURING):
        seen.append(seq.state)
        seq.reset(0, "reconfigured")
    assert seen == [pb.WORKER_STATE_CONFIGURING] and seq.state == pb.WORKER_STATE_READY


def test_a_failed_configure_puts_the_state_back():
    seq = Sequencer("pod 0", poll_s=POLL_S)
    with pytest.raises(RuntimeError):
        with seq.hold("a configure", deadline=0.0, state=pb.WORKER_STATE_CONFIGURING):
            raise RuntimeError("compile failed")
    assert seq.state == pb.WORKER_STATE_IDLE
    _run(seq, 0)          # and the pod is free again


def test_steps_run_in_order_whatever_order_they_arrive_in():
    seq = _ready()
    order = []
    waiters = {}
    for step in (2, 1):            # later steps arrive first (the controller pipelines)
        waiters[step] = Waiter(seq, step)
    time.sleep(0.1)
    assert not any(w.started.is_set() for w in waiters.values())
    seq.begin_step(0, seq.epoch, _soon())
    assert seq.state == pb.WORKER_STATE_STEPPING
    order.append(0)
    seq.finish_step(0, 1, ok=True)
    for step in (1, 2):
        assert waiters[step].started.wait(5), f"step {step} never started"
        assert seq.state == pb.WORKER_STATE_STEPPING and seq.next_step == step
        order.append(step)
        seq.finish_step(step, step + 1, ok=True)
    for w in waiters.values():
        assert w.join().error is None
    assert order == [0, 1, 2] and seq.state == pb.WORKER_STATE_READY and seq.next_step == 3


def test_a_step_waits_while_the_previous_one_runs():
    seq = _ready()
    seq.begin_step(0, seq.epoch, _soon())
    waiter = Waiter(seq, 1)
    time.sleep(0.1)
    assert not waiter.started.is_set()         # busy: step 0 still running
    seq.finish_step(0, 1, ok=True)
    assert waiter.started.wait(5) and waiter.join().error is None


def test_a_failed_step_keeps_its_state_and_refuses_later_steps():
    seq = _ready()
    _run(seq, 0)
    seq.begin_step(1, seq.epoch, _soon())
    waiter = Waiter(seq, 2)                    # queued behind the step that is about to fail
    seq.finish_step(1, 1, ok=False)
    assert seq.state == pb.WORKER_STATE_FAILED and seq.next_step == 1
    assert isinstance(waiter.join().error, StepAborted) and "step 1 failed" in str(waiter.error)
    with pytest.raises(StepAborted, match="step 1 failed"):
        seq.begin_step(3, seq.epoch, _soon())
    # Retrying the failed step itself is allowed; once it goes through, the pod is READY again.
    _run(seq, 1)
    assert seq.state == pb.WORKER_STATE_READY and seq.next_step == 2


def test_a_restore_aborts_the_steps_of_the_old_timeline():
    seq = _ready()
    _run(seq, 0)
    old_epoch = seq.epoch
    waiters = [Waiter(seq, 2), Waiter(seq, 5)]   # both wait: the pod is at step 1
    time.sleep(0.1)
    with seq.hold("a restore", _soon(), state=pb.WORKER_STATE_RESTORING):
        assert seq.state == pb.WORKER_STATE_RESTORING
        seq.reset(5, "restored to a checkpoint")
    assert seq.state == pb.WORKER_STATE_READY and seq.next_step == 5
    for w in waiters:     # step 5 too, although its number now fits: it was sent for the old timeline
        assert isinstance(w.join().error, StepAborted) and "restored to a checkpoint" in str(w.error)
    with pytest.raises(StepAborted, match="restored to a checkpoint"):
        seq.begin_step(5, old_epoch, _soon())
    _run(seq, 5)                                 # the new timeline steps on
    assert seq.next_step == 6


def test_a_restore_clears_a_failure():
    seq = _ready()
    _run(seq, 0, ok=False)
    assert seq.state == pb.WORKER_STATE_FAILED
    with seq.hold("a restore", _soon(), state=pb.WORKER_STATE_RESTORING):
        seq.reset(0, "restored to a checkpoint")
    assert seq.state == pb.WORKER_STATE_READY
    _run(seq, 0)
    _run(seq, 1)                                 # later steps are no longer refused


def test_a_failed_restore_puts_the_state_back():
    seq = _ready()
    _run(seq, 0, ok=False)
    with pytest.raises(ValueError):
        with seq.hold("a restore", _soon(), state=pb.WORKER_STATE_RESTORING):
            raise ValueError("corrupt checkpoint")
    assert seq.state == pb.WORKER_STATE_FAILED
    with pytest.raises(StepAborted):
        seq.begin_step(1, seq.epoch, _soon())


def test_steps_queued_before_a_restore_are_aborted_even_if_their_number_fits():
    seq = _ready()
    _run(seq, 0)
    seq.begin_step(1, seq.epoch, _soon())
    waiter = Waiter(seq, 3)                        # will fit the restored step number
    restored = threading.Event()

    def restore():
        with seq.hold("a restore", _soon(), state=pb.WORKER_STATE_RESTORING):
            seq.reset(3, "restored to a checkpoint")
        restored.set()
    thread = threading.Thread(target=restore)
    thread.start()
    time.sleep(0.1)
    assert not restored.is_set()                   # the restore waits for the running step
    seq.finish_step(1, 2, ok=True)
    thread.join(5)
    assert restored.is_set()
    assert isinstance(waiter.join().error, StepAborted) and "restored" in str(waiter.error)


def test_a_step_whose_predecessor_never_finishes_is_aborted_at_its_deadline():
    seq = _ready()
    start = time.monotonic()
    with pytest.raises(StepAborted, match="did not finish in time"):
        seq.begin_step(1, seq.epoch, time.monotonic() + 0.2)    # step 0 never comes
    assert 0.2 <= time.monotonic() - start < 2.0
    assert seq.state == pb.WORKER_STATE_READY                  # nothing else changed
    _run(seq, 0)


def test_a_cancelled_waiter_ends_with_cancelled():
    seq = _ready()
    active = threading.Event()
    active.set()
    waiter = Waiter(seq, 1, is_active=active.is_set)
    time.sleep(0.1)
    active.clear()                                             # the caller goes away
    assert isinstance(waiter.join().error, Cancelled)
    _run(seq, 0)
    _run(seq, 1)                                               # the pod is unharmed


def test_an_already_done_step_is_refused():
    seq = _ready()
    _run(seq, 0)
    _run(seq, 1)
    with pytest.raises(AlreadyDone, match="step 0 is already done"):
        seq.check_not_done(0)
    with pytest.raises(AlreadyDone):
        seq.begin_step(1, seq.epoch, _soon())
    # A duplicate of the running step: refused once that step is done.
    seq.begin_step(2, seq.epoch, _soon())
    waiter = Waiter(seq, 2)
    seq.finish_step(2, 3, ok=True)
    assert isinstance(waiter.join().error, AlreadyDone)


def test_a_hold_waits_for_a_running_step_then_says_busy_at_its_deadline():
    seq = _ready()
    seq.begin_step(0, seq.epoch, _soon())
    with pytest.raises(Busy, match="step 0 is still running"):
        with seq.hold("a save's host copy", time.monotonic() + 0.1):
            pass
    with pytest.raises(Busy):            # deadline in the past: refused at once
        with seq.hold("a configure", 0.0, state=pb.WORKER_STATE_CONFIGURING):
            pass
    assert seq.state == pb.WORKER_STATE_STEPPING
    seq.finish_step(0, 1, ok=True)
    with seq.hold("a save's host copy", _soon()):
        waiter = Waiter(seq, 1)          # a step waits for the hold
        time.sleep(0.1)
        assert not waiter.started.is_set()
    assert waiter.started.wait(5) and waiter.join().error is None
