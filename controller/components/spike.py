"""The loss-spike policy: a step whose loss exceeds spike.threshold times the mean of the last
spike.window losses is a spike (with spike.policy = "rewind"; recovery.py rewinds, skipping
spike.skip_batches)."""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING

from multipod.controller.core import fault_hooks as faults
from multipod.controller.core.policies import OnSpike

if TYPE_CHECKING:
    from multipod.controller.core.run_config import SpikeConfig
    from multipod.controller.observe.records import StepRecord


# Judged steps remembered for restart_at (a few hundred KB): more than a checkpoint interval.
HISTORY = 10_000


class Spike(Exception):
    """A loss spike at `step`: `loss` against the recent mean `mean`."""

    def __init__(self, step: int, loss: float, mean: float):
        super().__init__(f"step {step}: loss {loss:.4f} is a spike (recent mean {mean:.4f})")
        self.step, self.loss, self.mean = step, loss, mean


class SpikePolicy:
    """Judges each step's record against a window of recent finite, unskipped losses. config:
    the run's [spike] (recovery.py reads its skip_batches when it rewinds)."""

    def __init__(self, config: SpikeConfig):
        self.config = config
        self.enabled = config.policy == OnSpike.REWIND
        self.threshold = config.threshold
        self.losses: collections.deque[float] = collections.deque(maxlen=config.window)
        # (step, loss) of the judged steps of this timeline, newest last: after a restore to step s
        # the window is rebuilt from the steps before s, as the uninterrupted run holds it there.
        self._history: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY)
        # The test hook is read once, here (controller/core/fault_hooks.py).
        self._test_spike_batch = faults.spike_batch()

    def with_test_spike(self, record: StepRecord) -> StepRecord:
        """The record as the test hook makes it (controller/core/fault_hooks.py): its loss inflated
        when it trained on the hook's batch; else the record itself."""
        if self._test_spike_batch is None or record.data_index != self._test_spike_batch:
            return record
        return dataclasses.replace(record, loss=record.loss * faults.SPIKE_FACTOR)

    def check(self, record: StepRecord) -> Spike | None:
        """The Spike this record is (the caller raises it once the record is logged), or None.
        Skipped and non-finite steps are ignored; nothing is judged until the window is full."""
        loss = record.loss
        if record.skipped or not math.isfinite(loss):
            return None
        if self.enabled and len(self.losses) == self.losses.maxlen:
            mean = sum(self.losses) / len(self.losses)
            if loss > self.threshold * mean:
                return Spike(record.step, loss, mean)
        self.losses.append(loss)
        self._history.append((record.step, loss))
        return None

    def restart_at(self, step: int) -> None:
        """The run goes on from `step` (a checkpoint restored after a pod failure or a spike): the
        window becomes the losses of the steps before it, those of the abandoned steps are
        forgotten. So a restored run judges each step as the uninterrupted run does (a restore
        more than HISTORY judged steps back starts with a partial window)."""
        while self._history and self._history[-1][0] >= step:
            self._history.pop()
        self.losses.clear()
        self.losses.extend(loss for _, loss in list(self._history)[-self.losses.maxlen:])
