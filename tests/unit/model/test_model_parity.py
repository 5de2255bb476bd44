"""Sharded (2x2 data x model mesh) loss and gradients equal the single-device result."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from multipod.model import abstract_params, init_params, loss_sums, partitioning


def _loss_and_grads(config):
    def fn(params, tokens):
        def total(p):
            ce, z = loss_sums(p, tokens, config)
            return ce + z, (ce, z)
        (_, (ce, z)), grads = jax.value_and_grad(total, has_aux=True)(params)
        return ce, z, grads
    return fn


def test_mesh_has_auto_axes():
    mesh = partitioning.make_mesh(2, 2)
    assert mesh.axis_names == partitioning.MESH_AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_sharded_loss_and_grads_match_single_device(tiny_config, tiny_params):
    tokens = np.random.RandomState(0).randint(0, 256, size=(4, 17)).astype(np.int32)
    fn = _loss_and_grads(tiny_config)
    ce_ref, z_ref, grads_ref = jax.jit(fn)(tiny_params, tokens)

    mesh = partitioning.make_mesh(data=2, model=2)
    shardings = partitioning.param_shardings(abstract_params(tiny_config), mesh)
    rep = partitioning.replicated(mesh)
    with partitioning.activate_rules(mesh):
        params = jax.device_put(tiny_params, shardings)
        batch = jax.device_put(tokens, partitioning.batch_sharding(mesh))
        step = jax.jit(fn, in_shardings=(shardings, partitioning.batch_sharding(mesh)),
                       out_shardings=(rep, rep, shardings))
        ce, z, grads = step(params, batch)

    # The layout really is split: half of an MLP kernel / the vocab / the batch per device.
    gate = params["block_0"]["mlp"]["gate"]
    assert gate.sharding.spec == P(None, "model")
    assert gate.addressable_shards[0].data.shape == (32, 32)
    assert params["embedding"].addressable_shards[0].data.shape == (128, 32)
    assert params["block_0"]["attn"]["query"].addressable_shards[0].data.shape == (32, 2, 8)
    assert params["block_0"]["attn"]["key"].sharding.is_fully_replicated
    assert batch.addressable_shards[0].data.shape == (2, 17)
    assert grads["block_1"]["mlp"]["down"].sharding.spec == P("model", None)

    np.testing.assert_allclose(ce, ce_ref, rtol=1e-5)
    np.testing.assert_allclose(z, z_ref, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_sharded_init_equals_unsharded(tiny_config, tiny_params):
    mesh = partitioning.make_mesh(2, 2)
    shardings = partitioning.param_shardings(abstract_params(tiny_config), mesh)
    sharded = init_params(tiny_config, seed=0, shardings=shardings)
    assert sharded["block_0"]["mlp"]["up"].sharding.spec == P(None, "model")
    leaves = zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(tiny_params))
    for got, want in leaves:
        np.testing.assert_array_equal(got, want)


def test_param_shardings_reject_indivisible_dims(tiny_config):
    bad = dataclasses.replace(tiny_config, n_heads=3)
    with pytest.raises(ValueError, match=r"\[.attn.\].*not divisible"):
        partitioning.param_shardings(abstract_params(bad), partitioning.make_mesh(2, 2))


def test_batch_and_replicated_specs():
    mesh = partitioning.make_mesh(2, 2)
    assert partitioning.batch_sharding(mesh).spec == P("data", None)
    assert partitioning.replicated(mesh).is_fully_replicated


def test_abstract_params_are_traced_once_per_config(tiny_config):
    # Cached: the trainer, the overlapped step and generation each ask for them in one worker.
    first = abstract_params(tiny_config)
    assert abstract_params(tiny_config) is first
    assert abstract_params(dataclasses.replace(tiny_config, d_model=tiny_config.d_model * 2)) is not first


def test_a_sharded_init_reuses_the_trace_of_its_shapes(tiny_config, monkeypatch):
    # A worker asks for the shapes (to lay the parameters out), then for the values in that
    # layout: the model's init is traced once for both, the way a worker starts.
    from multipod.model import transformer
    traced = []
    real = transformer._boxed_init
    monkeypatch.setattr(transformer, "_boxed_init", lambda config, key: traced.append(config) or real(config, key))
    config = dataclasses.replace(tiny_config, mlp_dim=tiny_config.mlp_dim * 3)   # no cached trace yet
    mesh = partitioning.make_mesh(2, 2)
    shardings = partitioning.param_shardings(abstract_params(config), mesh)
    params = init_params(config, seed=0, shardings=shardings)
    assert len(traced) == 1
    assert jax.tree.map(lambda p: p.sharding, params) == shardings
    for sharded, plain in zip(jax.tree.leaves(params), jax.tree.leaves(init_params(config, seed=0))):
        np.testing.assert_array_equal(np.asarray(sharded), np.asarray(plain))    # the layout changes no value
