"""DiLoCo's replay history within sync.replay_history_mb (pod_worker/diloco_replicas.py): a pod
keeps the agreed values of each outer step since its checkpoint before last for a replay; past
the budget it forgets them instead of running out of host memory, a replay that would need them
is refused naming the setting, and training is unchanged."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from multipod.model.config import ConfigError
from multipod.pod_worker.schema import SyncConfig
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config
from tests.unit.pod_worker.test_diloco import COLS, ROWS, tokens

STEPS = 6


def _trainer(**sync) -> PodTrainer:
    base = tiny_worker_config()
    config = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=ROWS),
                                 sync=SyncConfig(mode="diloco", inner_steps=1, outer_optimizer="sgd", outer_lr=1.0,
                                                 outer_momentum=0.0, **sync)).validate()
    trainer = PodTrainer(config, devices=jax.devices()[:1])
    trainer.start_outer(1)
    trainer.outer.trim_history(0)       # what the pod's first save (the run's baseline) does
    return trainer


def _train(trainer: PodTrainer, on_step=lambda: None) -> None:
    for step in range(STEPS):
        trainer.train_step(trainer.put_batch(tokens(step, 0)), ROWS * (COLS - 1), None)
        assert trainer.outer_step(None) is not None
        on_step()


def test_past_the_budget_the_history_is_forgotten_and_a_replay_needing_it_is_refused():
    trainer, unbounded = _trainer(replay_history_mb=1), _trainer()
    outer = trainer.outer
    model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.params))
    kept = (1 << 20) // model_bytes             # whole-model outer steps (H = 1, one fragment) that fit
    assert 1 <= kept < STEPS - 1, "the test needs the budget to overflow once and keep some steps after"
    _train(trainer, lambda: pytest.fail("over the budget") if outer.history_bytes > 1 << 20 else None)
    _train(unbounded)
    # Outer step kept + 1 overflowed: forgotten, and the history starts again after it.
    assert outer.history_from == kept + 1
    assert [entry[1] for entry in outer.history] == list(range(kept + 2, STEPS + 1))
    assert outer.history_bytes == sum(v.nbytes for entry in outer.history for v in entry[3])
    assert [entry[1] for entry in unbounded.outer.history] == list(range(1, STEPS + 1))
    with pytest.raises(ValueError, match="sync.replay_history_mb") as refused:
        outer.check_history(0)                  # the baseline checkpoint's replay needs the forgotten steps
    assert f"since step {kept + 1} only" in str(refused.value)
    outer.check_history(kept + 1)               # a checkpoint at or after it could still be replayed
    # Forgetting changes nothing the pods train.
    for mine, theirs in zip(jax.tree.leaves((outer.agreed_state(), trainer.params, trainer.opt_state)),
                            jax.tree.leaves((unbounded.outer.agreed_state(), unbounded.params, unbounded.opt_state))):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_a_save_trims_the_history_and_its_size():
    trainer = _trainer()
    _train(trainer)
    outer = trainer.outer
    outer.trim_history(4)
    assert [entry[1] for entry in outer.history] == [5, 6] and outer.history_from == 4
    assert outer.history_bytes == sum(v.nbytes for entry in outer.history for v in entry[3]) > 0


def test_a_budget_of_nothing_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as caught:
        SyncConfig(mode="diloco", replay_history_mb=0).validate()
    assert caught.value.field == "sync.replay_history_mb"


def test_an_outer_step_alone_past_the_budget_keeps_nothing_and_warns_once(caplog):
    trainer = _trainer()
    outer = trainer.outer
    model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.params))
    # The tiny model is under the smallest bound the config takes (1 MiB): the test sets the
    # budget below one outer step's values (H = 1, one fragment: the whole model) directly.
    outer.history_budget_bytes = model_bytes - 1
    with caplog.at_level("WARNING", logger="multipod.pod_worker.diloco_replicas"):
        _train(trainer)
    warned = [r for r in caplog.records if "one outer step's values" in r.getMessage()]
    assert len(warned) == 1, "the warning should be given once, not at every outer step"
    assert outer.history == [] and outer.history_bytes == 0 and outer.history_from == STEPS
    with pytest.raises(ValueError, match="sync.replay_history_mb"):
        outer.check_history(STEPS - 1)
    outer.check_history(STEPS)      # a checkpoint with no outer step since could still be replayed
