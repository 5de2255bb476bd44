"""The overlapped gradient step (pod_worker/overlap.py, dcn.overlap): per-layer programs give the
fused step's gradients to float tolerance, on one device and on a 2x2 mesh, and hand the exchange
the leaves in readiness order (the last block first, the embedding last)."""
import dataclasses

import jax
import numpy as np
import pytest

from multipod.model import ConfigError
from multipod.pod_worker.schema import DcnConfig, MeshConfig
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config


def _config(mesh=(1, 1), overlap=True, **model):
    base = tiny_worker_config()
    return dataclasses.replace(base, mesh=MeshConfig(data=mesh[0], model=mesh[1]),
                               dcn=DcnConfig(overlap=overlap),
                               model=dataclasses.replace(base.model, **model)).validate()


def _tokens(seed=0, rows=4, length=33):
    return np.random.default_rng(seed).integers(0, 256, (rows, length)).astype(np.int32)


def _part_names(trainer):
    """The top-level parameter name ("block_0", "embedding", ...) of each flattened leaf."""
    return [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(trainer.params)[0]]


@pytest.mark.parametrize("mesh,model", [
    ((1, 1), {}),
    ((2, 2), {}),
    ((2, 2), {"sequence_parallel": True, "remat": "selective"}),
    ((1, 1), {"remat": "full"}),
])
def test_overlapped_gradients_equal_the_fused_gradients(mesh, model):
    trainer = PodTrainer(_config(mesh, **model), jax.devices()[: mesh[0] * mesh[1]])
    batch = trainer.put_batch(_tokens())
    fused, ce, z = trainer.gradients(batch, global_tokens=4 * 32)
    norm = jax.device_put(np.float32(4 * 32), trainer.scalar_sharding)
    launched = trainer._overlapped.launch(trainer.params, batch, norm)
    assert float(launched.ce) == pytest.approx(ce, rel=1e-5)
    assert float(launched.z) == pytest.approx(z, rel=1e-5)
    assert len(launched.leaves) == len(fused)
    for name, want, got, sharding in zip(_part_names(trainer), fused, launched.leaves,
                                         jax.tree.leaves(trainer.param_sharding)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert got.sharding.is_equivalent_to(sharding, got.ndim), name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-7, err_msg=name)
    assert any(np.abs(np.asarray(leaf)).max() > 0 for leaf in launched.leaves)


def test_leaves_are_handed_to_the_exchange_in_readiness_order():
    trainer = PodTrainer(_config(n_layers=3), jax.devices()[:1])
    calls = []

    def all_reduce(leaves, order=None):
        # Take each leaf in the given order (as the exchange does), blocking on it only then.
        calls.append((list(order), [np.asarray(leaves[i]).copy() for i in order]))
        return leaves, None

    outcome = trainer.train_step(trainer.put_batch(_tokens()), 4 * 32, all_reduce)
    (order, taken), = calls
    assert sorted(order) == list(range(len(jax.tree.leaves(trainer.params))))
    names = _part_names(trainer)
    parts = []
    for i in order:       # the parts in the order their leaves were handed over, without repeats
        if not parts or parts[-1] != names[i]:
            parts.append(names[i])
    assert parts == ["final_norm", "block_2", "block_1", "block_0", "embedding"]
    assert all(np.isfinite(t).all() for t in taken)
    assert outcome.exposed_exchange_s >= 0.0 and outcome.compute_s > 0.0


def test_overlap_on_and_off_train_alike():
    """Three steps of train_step with an identity exchange: same losses and parameters."""
    runs = {}
    for overlap in (False, True):
        trainer = PodTrainer(_config(overlap=overlap), jax.devices()[:1])
        losses = [trainer.train_step(trainer.put_batch(_tokens(seed=s)), 4 * 32).loss_sum for s in range(3)]
        runs[overlap] = losses, trainer.params
    (off_losses, off_params), (on_losses, on_params) = runs[False], runs[True]
    np.testing.assert_allclose(on_losses, off_losses, rtol=1e-5)
    assert on_losses[-1] != on_losses[0]
    for a, b in zip(jax.tree.leaves(on_params), jax.tree.leaves(off_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


def test_overlap_is_refused_with_microbatches_naming_the_field():
    with pytest.raises(ConfigError, match="model.microbatches"):
        _config(overlap=True, microbatches=2)
    assert _config(overlap=False, microbatches=2).model.microbatches == 2
