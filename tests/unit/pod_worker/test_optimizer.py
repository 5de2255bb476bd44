"""The learning-rate schedules (pod_worker/optimizer.py): cosine, and warmup-stable-decay, whose
rates before its decay do not depend on the schedule's length (what lets a wsd run resume with
another length: pod_worker/checkpoint.py)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from multipod.model.config import ConfigError
from multipod.pod_worker.optimizer import make_schedule
from multipod.pod_worker.schema import LrSchedule, OptimizerConfig, WorkerConfig, build

WSD = OptimizerConfig(learning_rate=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule=LrSchedule.WSD,
                      decay_fraction=0.25)


def rates(opt: OptimizerConfig, schedule_steps: int, steps: int) -> np.ndarray:
    """The rates of steps 0 .. steps-1, as the trainer computes them (one program, PodTrainer.schedule)."""
    schedule = jax.jit(jax.vmap(make_schedule(opt, schedule_steps)))
    return np.asarray(schedule(np.arange(steps, dtype=np.int32)), np.float32)


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_to_its_floor():
    assert WSD.decay_start(20) == 15
    got = rates(WSD, 20, 24)
    np.testing.assert_allclose(got[:5], [0.0, 0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert (got[4:16] == 1.0).all()                                   # the stable phase, exactly the peak
    np.testing.assert_allclose(got[15:21], [1.0, 0.82, 0.64, 0.46, 0.28, 0.1], rtol=1e-5)
    assert (got[20:] == got[20]).all()                                # the floor held after the end
    # No decay at all (decay_fraction 0): the peak from the warmup's end on.
    assert (rates(dataclasses.replace(WSD, decay_fraction=0.0), 20, 24)[4:] == 1.0).all()
    # The decay never starts inside the warmup.
    assert dataclasses.replace(WSD, decay_fraction=1.0).decay_start(20) == 4


def test_wsd_rates_before_the_decay_do_not_depend_on_the_length():
    """Bitwise: the steps a checkpoint of a 20-step wsd run took before its decay (step 15) ran at
    the rates a 100-step run takes; cosine's rates depend on its length from the warmup's end on."""
    short, long = rates(WSD, 20, 15), rates(WSD, 100, 15)
    assert short.tobytes() == long.tobytes()
    cosine = dataclasses.replace(WSD, schedule=LrSchedule.COSINE)
    assert rates(cosine, 20, 15)[5:].tobytes() != rates(cosine, 100, 15)[5:].tobytes()


def test_the_schedule_and_its_decay_are_checked_naming_the_field():
    with pytest.raises(ConfigError, match="optimizer.schedule"):
        build(WorkerConfig, {"optimizer": {"schedule": "linear"}}).validate()
    with pytest.raises(ConfigError, match=r"optimizer.decay_fraction.*\[0, 1\]"):
        build(WorkerConfig, {"optimizer": {"schedule": "wsd", "decay_fraction": 1.5}}).validate()
    assert build(WorkerConfig, {"optimizer": {"schedule": "wsd"}}).optimizer.schedule is LrSchedule.WSD
