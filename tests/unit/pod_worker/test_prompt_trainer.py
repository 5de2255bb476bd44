"""A pod tuning a prompt (pod_worker/prompt_trainer.py): it trains and exchanges the prompt
parameters alone, its base stays bitwise as loaded, a prompt checkpoint is only restored onto the
base it was tuned on, and a base that does not fit the run is refused naming the field."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from multipod.model import ModelConfig
from multipod.model.config import ConfigError
from multipod.pod_worker import checkpoint
from multipod.pod_worker.prompt_trainer import PromptTrainer
from multipod.pod_worker.schema import PromptConfig, SyncConfig, TrainShape, WorkerConfig
from multipod.pod_worker.trainer import PodTrainer, fingerprint

MODEL = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=64, max_seq_len=24)
BASE = WorkerConfig(model=MODEL, train=TrainShape(seq_len=16, global_batch=4))


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    trainer = PodTrainer(BASE, devices=jax.devices()[:1])    # tuned on 2 devices below
    rng = np.random.default_rng(0)
    for _ in range(2):
        trainer.train_step(trainer.put_batch(rng.integers(0, 128, (4, 17)).astype(np.int32)), 64)
    meta = {"worker_config": BASE.to_dict(), "state_key": BASE.state_key()}
    path = checkpoint.save(str(tmp_path_factory.mktemp("base")), trainer.host_state(), trainer.fingerprint(),
                           json.dumps(meta))
    return path, fingerprint(trainer.params)


def _config(path, kind="mlp", model=MODEL):
    return dataclasses.replace(BASE, model=model, train=TrainShape(seq_len=12, global_batch=4),
                               prompt=PromptConfig(kind=kind, virtual_tokens=4, hidden=16,
                                                   base_checkpoint=str(path))).validate()


def test_only_the_prompt_trains_and_the_base_stays_as_loaded(base_checkpoint):
    path, base_params_fingerprint = base_checkpoint
    trainer = PromptTrainer(_config(path), devices=jax.devices()[:2])
    assert trainer.mesh_shape == (2, 1) and trainer.base_fingerprint == base_params_fingerprint
    # What the DCN exchange carries: the prompt encoder's leaves, a few kilobytes.
    assert sum(s.nbytes for s in trainer.leaf_specs) < 20_000
    before = trainer.fingerprint()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128, (4, 13)).astype(np.int32)
    mask = np.zeros((4, 12), np.uint8)
    mask[:, 6:] = 1
    losses = []
    for _ in range(4):
        outcome = trainer.train_step(trainer.put_batch(tokens, mask), int(mask.sum()))
        losses.append(outcome.loss_sum / outcome.tokens)
    assert outcome.tokens == 24 and trainer.step == 4
    assert trainer.fingerprint() != before and losses[-1] < losses[0]
    assert fingerprint(trainer.base) == base_params_fingerprint
    saved = trainer.save_metadata()
    assert saved["base_fingerprint"] == base_params_fingerprint
    assert saved["base_checksum"] == saved["base_checksum_loaded"] == trainer.base_checksum_loaded
    assert trainer.evaluate(tokens, mask)[1] == 24 and trainer.evaluate(tokens)[1] == 4 * 12


def test_a_diloco_run_s_part_gives_its_agreed_parameters_as_the_base(tmp_path):
    """A DiLoCo pod's checkpoint part holds its own parameters and the agreed ones (and the outer
    optimizer's state, here with a sync pending); the base a prompt is tuned on is the agreed
    parameters, the model the run evaluated and sampled, not the pod's own."""
    diloco = dataclasses.replace(BASE, sync=SyncConfig(mode="diloco", inner_steps=4, fragments=2,
                                                       overlap_steps=1)).validate()
    trainer = PodTrainer(diloco, devices=jax.devices()[:1])
    trainer.start_outer(1)
    rng = np.random.default_rng(0)
    for _ in range(2):      # the first fragment's sync starts after 2 inner steps, applied after a 3rd
        trainer.train_step(trainer.put_batch(rng.integers(0, 128, (4, 17)).astype(np.int32)), 64)
        trainer.outer_step(None)
    # Saved as a pod saves its part (pod_worker/checkpoint_pod.py).
    state = {"params": trainer.params, "opt_state": trainer.opt_state, "step": trainer.step}
    state["outer"], outer_meta = trainer.outer.checkpoint(30.0)
    assert outer_meta["pending"] and "pending" in state["outer"]
    meta = {"worker_config": diloco.to_dict(), "state_key": diloco.state_key(), "outer": outer_meta}
    path = checkpoint.save(str(tmp_path / "pod-0"), state,
                           fingerprint(state["params"], state["opt_state"], state["outer"]), json.dumps(meta))
    agreed, own = fingerprint(trainer.agreed_params), fingerprint(trainer.params)
    assert agreed != own
    tuned = PromptTrainer(_config(path), devices=jax.devices()[:2])
    assert tuned.base_fingerprint == agreed and fingerprint(tuned.base) == agreed


def test_a_prompt_checkpoint_is_restored_only_onto_its_base(base_checkpoint):
    path, base_params_fingerprint = base_checkpoint
    trainer = PromptTrainer(_config(path, kind="prompt"))
    trainer.check_restorable("p", {"base_fingerprint": base_params_fingerprint})
    with pytest.raises(checkpoint.CheckpointError, match="tuned on a base model with fingerprint 0123"):
        trainer.check_restorable("p", {"base_fingerprint": "0123", "base_checkpoint": "/elsewhere"})


def test_a_base_of_another_model_is_refused_naming_the_field(base_checkpoint):
    path, _ = base_checkpoint
    with pytest.raises(ConfigError, match=r"model\.rope_base.*base checkpoint"):
        PromptTrainer(_config(path, model=dataclasses.replace(MODEL, rope_base=500.0)))


def test_a_pod_training_the_whole_model_refuses_a_loss_mask():
    trainer = PodTrainer(BASE)
    with pytest.raises(ValueError, match="loss mask is taken only by a pod tuning a prompt"):
        trainer.put_batch(np.zeros((4, 17), np.int32), np.ones((4, 16), np.uint8))


def test_a_survivor_computes_a_failed_pod_s_masked_shard_as_that_pod_would(base_checkpoint):
    # Degraded mode for a prompt: the failed pod's shard, with its own loss mask, gives the
    # exchange bitwise the gradient that pod would have given.
    from tests.unit.pod_worker.test_degraded_step import Recorded, Recorder, assert_leaves_bitwise
    path, _ = base_checkpoint
    config = _config(path)
    survivor, reference = (PromptTrainer(config, devices=jax.devices()[:2]) for _ in range(2))
    rng = np.random.default_rng(4)
    shards = {}
    for slot, first in ((0, 5), (1, 9)):
        mask = np.zeros((4, 12), np.uint8)
        mask[:, first:] = 1
        shards[slot] = (rng.integers(0, 128, (4, 13)).astype(np.int32), mask)
    global_tokens = sum(int(mask.sum()) for _, mask in shards.values())
    alone = Recorder(fail=True)
    with pytest.raises(Recorded):
        reference.train_step(reference.put_batch(*shards[1]), global_tokens, alone)
    recorder = Recorder()
    outcome = survivor.train_step(survivor.put_batch(*shards[0]), global_tokens, recorder,
                                  extra={1: survivor.put_batch(*shards[1])})
    assert_leaves_bitwise(recorder.calls[0]["extra"][1], alone.calls[0]["own"])
    assert outcome.tokens == global_tokens and [s[3] for s in outcome.shards] == [28, 12]
