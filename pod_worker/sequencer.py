"""When may step N run, and what the worker is doing (`pb.WorkerState`, reported by Status).

A pod does one thing at a time: a step, or a *hold* (configure, restore, a save's host copy, an
evaluation). Steps arrive early on purpose (the controller pipelines them), so a step waits until
the pod is free and at its step. Every wait ends, each exit with its own typed error:

    the pod is free and at step N        -> run it
    the epoch changed (reconfigured or   -> StepAborted: the step belongs to an abandoned timeline
      restored since the request came)
    an earlier step failed               -> StepAborted: step N cannot follow it
    the caller cancelled                 -> Cancelled
    step N is already done               -> AlreadyDone
    the deadline passed                  -> StepAborted: the previous step did not finish in time

States: IDLE -> (hold: CONFIGURING) -> READY <-> STEPPING; a failed step -> FAILED (the state is
the one before that step); a successful Configure or Restore -> READY. A hold that fails puts the
state back as it was.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from multipod.pod_worker.errors import AlreadyDone, Busy, Cancelled, StepAborted
from multipod.protos import multipod_pb2 as pb


def _always() -> bool:
    return True


class Sequencer:
    """The step-ordering state machine of one pod; thread-safe."""

    def __init__(self, name: str = "pod", poll_s: float = 1.0):
        self.name = name                # for messages, e.g. "pod 3"
        self._poll_s = poll_s           # how often a waiting step rechecks its caller is still there
        self._cond = threading.Condition()
        self._state: int = pb.WORKER_STATE_IDLE
        self._running: str | None = None   # what has the pod ("step 5", "a restore"); None: free
        self._next_step = 0
        self._failed_step: int | None = None
        self._epoch = 0
        self._epoch_why = ""

    @property
    def state(self) -> int:
        """The current pb.WorkerState value."""
        return self._state

    @property
    def epoch(self) -> int:
        """Bumped by every reset (configure, restore); a step carries the epoch it arrived in."""
        return self._epoch

    @property
    def next_step(self) -> int:
        """The step the pod runs next."""
        return self._next_step

    def check_not_done(self, step: int) -> None:
        """AlreadyDone if `step` is behind the pod (a cheap refusal before any work)."""
        with self._cond:
            if step < self._next_step:
                raise AlreadyDone(f"step {step} is already done ({self.name} is at step {self._next_step})")

    def begin_step(self, step: int, epoch: int, deadline: float, is_active: Callable[[], bool] = _always) -> None:
        """Wait until `step` may run (see the module doc for every exit), then mark it running.

        `epoch` is the one the request arrived in; `deadline` is on time.monotonic()'s clock."""
        with self._cond:
            while True:
                if self._epoch != epoch:
                    raise StepAborted(f"{self.name} was {self._epoch_why}; step {step} belongs to the timeline before")
                if self._failed_step is not None and self._failed_step < step:
                    raise StepAborted(f"step {self._failed_step} failed on {self.name}; step {step} cannot run")
                if self._running is None and self._next_step == step:
                    break
                if not is_active():
                    raise Cancelled("the controller cancelled the step")
                if step < self._next_step:
                    raise AlreadyDone(f"step {step} is already done ({self.name} is at step {self._next_step})")
                left = deadline - time.monotonic()
                if left <= 0:
                    doing = f"; {self._running} is running" if self._running else ""
                    raise StepAborted(f"{self.name} still at step {self._next_step}{doing}: the steps before "
                                      f"step {step} did not finish in time")
                self._cond.wait(min(left, self._poll_s))
            self._running = f"step {step}"
            self._state = pb.WORKER_STATE_STEPPING

    def finish_step(self, step: int, next_step: int, ok: bool) -> None:
        """End the running step: on success the pod is at `next_step`; on failure it is FAILED and
        later steps are refused until a reset (a retry of the same step may still run)."""
        with self._cond:
            self._running = None
            self._next_step = next_step
            if ok:   # (a failure can only be this very step, retried: later ones are refused)
                self._failed_step = None
                self._state = pb.WORKER_STATE_READY
            else:
                self._failed_step = step
                self._state = pb.WORKER_STATE_FAILED
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self, what: str, deadline: float, state: int | None = None) -> Iterator[None]:
        """Have the pod to oneself (no step runs meanwhile), waiting for it until `deadline`
        (Busy then); with `state`, report that state meanwhile. Put a deadline in the past to
        refuse at once if the pod is busy."""
        with self._cond:
            while self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(f"{self.name}: {self._running} is still running")
                self._cond.wait(min(left, self._poll_s))
            self._running = what
            before = self._state
            if state is not None:
                self._state = state
        try:
            yield
        finally:
            with self._cond:
                self._running = None
                if state is not None and self._state == state:   # the hold did not reset: as it was
                    self._state = before
                self._cond.notify_all()

    def reset(self, step: int, why: str) -> int:
        """Start a new timeline at `step` (call inside a hold, after a configure or restore): steps
        of the old one are refused, an earlier failure is forgotten, the state is READY. Returns
        the new epoch."""
        with self._cond:
            self._epoch += 1
            self._epoch_why = why
            self._next_step = step
            self._failed_step = None
            self._state = pb.WORKER_STATE_READY
            self._cond.notify_all()
            return self._epoch
