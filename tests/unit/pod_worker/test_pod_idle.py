"""Evaluate and Generate wait until the pod is idle. A step's update donates the parameters (XLA
reuses their buffers for the new state), so while it runs the pod's parameters are deleted
arrays. Both take the sequencer's hold (pod.py): during a step they are refused at once with a
past deadline, wait for it with a later one, and then read the state after the step."""
from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from multipod.model import Sampling
from multipod.pod_worker.errors import Busy
from multipod.pod_worker.generation import collect
from multipod.pod_worker.pod import Pod
from tests.helpers import tiny_worker_config

CONFIG = tiny_worker_config()
ROWS, COLS = CONFIG.train.global_batch, CONFIG.train.seq_len + 1
EVAL_TOKENS = np.random.default_rng(99).integers(0, 256, (ROWS, COLS), dtype=np.int32)
PROMPT = np.frombuffer(b"def ", np.uint8).astype(np.int32)


@pytest.fixture(scope="module")
def pod():
    pod = Pod(0)
    pod.configure(CONFIG, 1, [""], "idle-test")
    yield pod
    pod.close()


def _step(pod: Pod, step: int) -> None:
    tokens = np.random.default_rng(step).integers(0, 256, (ROWS, COLS), dtype=np.int32)
    pod.step(pod.setup(), step, tokens, ROWS * (COLS - 1), time.monotonic() + 120, lambda: True)


def _evaluate(pod: Pod, deadline: float):
    return pod.evaluate(EVAL_TOKENS, deadline)


def _generate(pod: Pod, deadline: float):
    out, lengths = collect(pod.generate_stream([PROMPT], 8, Sampling(), deadline), 1, 8)
    return out[0, :lengths[0]].tolist()


class _Thread(threading.Thread):
    """Runs fn(); keeps its result or its exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:   # re-raised by the test
            self.error = exc

    def outcome(self):
        self.join(120)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize("call, reads", [(_evaluate, "evaluate"), (_generate, "params_copy")])
def test_a_call_that_reads_the_parameters_waits_for_the_running_step(pod, monkeypatch, call, reads):
    trainer = pod.trainer
    if trainer.step == 0:
        _step(pod, 0)   # the first update's learning rate is 0: the next one changes the parameters
    before = call(pod, time.monotonic() + 120)
    log: list[str] = []
    inside, release = threading.Event(), threading.Event()
    # The step's compiled update: it runs (donating the parameters), then the step holds there.
    name = "_update_compiled" if getattr(trainer, "_update_compiled", None) is not None else "_apply_update"
    update = getattr(trainer, name)

    def blocked_update(*args):
        out = update(*args)
        log.append("update")
        inside.set()
        assert release.wait(60)
        log.append("released")
        return out
    monkeypatch.setattr(trainer, name, blocked_update)
    read = getattr(trainer, reads)

    def logged_read(*args):
        log.append("read")
        return read(*args)
    monkeypatch.setattr(trainer, reads, logged_read)
    hold, asked = pod.seq.hold, threading.Event()

    def asking_hold(*args, **kwargs):
        if inside.is_set():
            asked.set()
        return hold(*args, **kwargs)
    monkeypatch.setattr(pod.seq, "hold", asking_hold)

    step = _Thread(lambda: _step(pod, trainer.step))
    step.start()
    try:
        assert inside.wait(120)
        # What the wait protects against: mid-update, the parameters are donated buffers (an
        # evaluation without the hold here crashed the process with a segfault, jax 0.10 CPU).
        assert any(leaf.is_deleted() for leaf in jax.tree.leaves(trainer.params))
        with pytest.raises(Busy, match="step .* is still running"):
            call(pod, time.monotonic())     # a past deadline: refused at once, nothing read
        asked.clear()
        waiter = _Thread(lambda: call(pod, time.monotonic() + 120))
        waiter.start()
        assert asked.wait(60)               # the waiter has asked for the pod ...
        assert log == ["update"]            # ... and read nothing while the step holds it
    finally:
        release.set()
    step.outcome()
    during = waiter.outcome()
    assert log == ["update", "released", "read"]     # read once the step was done
    monkeypatch.undo()
    after = call(pod, time.monotonic() + 120)
    assert during == after                 # the parameters after the step
    if reads == "evaluate":
        assert during != before            # ... which the step did change
