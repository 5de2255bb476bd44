"""programs.py's builders are memoised on their configuration: a second trainer of the same model
in a process (a DiLoCo replica, a reconfigured pod, the in-process tests' pods) finds jax's traces
of the first one's programs, and another model gets programs of its own."""
import dataclasses

import jax
import numpy as np

from multipod.pod_worker import programs
from multipod.pod_worker.optimizer import make_optimizer
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config


def test_a_second_trainer_of_an_equal_config_finds_the_first_s_programs():
    config = tiny_worker_config()
    tokens = np.random.default_rng(3).integers(0, 256, (4, config.train.seq_len + 1), dtype=np.int32)
    first = PodTrainer(config, jax.devices()[:1])
    want = first.evaluate(tokens)
    # An equal config that is another object: the builders are keyed on its value.
    second = PodTrainer(dataclasses.replace(config, model=dataclasses.replace(config.model)), jax.devices()[:1])
    assert second._eval_step._cache_size() >= 1, "the second trainer traced its evaluation again"
    assert second.evaluate(tokens) == want


def test_another_model_or_optimizer_gets_programs_of_its_own():
    config = tiny_worker_config()
    other = dataclasses.replace(config.model, n_layers=config.model.n_layers + 1)
    assert programs.make_grad_step(config.model) is programs.make_grad_step(dataclasses.replace(config.model))
    assert programs.make_grad_step(other) is not programs.make_grad_step(config.model)
    assert programs.make_eval_step(other) is not programs.make_eval_step(config.model)
    faster = dataclasses.replace(config.optimizer, learning_rate=2 * config.optimizer.learning_rate)
    assert make_optimizer(faster, 10) is not make_optimizer(config.optimizer, 10)
    assert make_optimizer(config.optimizer, 10) is make_optimizer(dataclasses.replace(config.optimizer), 10)
