"""Transformer forward pass: init determinism, causality, dtypes, sharding annotations."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from multipod.model import Transformer, abstract_params, init_params, partitioning


def _tokens(shape, seed=0):
    return np.random.RandomState(seed).randint(0, 256, size=shape).astype(np.int32)


def _forward(config):
    return jax.jit(lambda params, tokens: Transformer(config).apply({"params": params}, tokens))


def test_init_is_deterministic_in_seed(tiny_config, tiny_params):
    again = init_params(tiny_config, seed=0)
    other = init_params(tiny_config, seed=1)
    same = jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), tiny_params, again)
    assert all(jax.tree_util.tree_leaves(same))
    for a, b in zip(jax.tree_util.tree_leaves(tiny_params), jax.tree_util.tree_leaves(other)):
        if a.ndim > 1:  # norm scales are all ones whatever the seed
            assert not np.array_equal(a, b)


def test_init_statistics(tiny_config, tiny_params):
    # Embedding std 1/sqrt(d_model) (see Transformer), other kernels init_std, norm scales 1.
    assert np.std(tiny_params["embedding"]) == pytest.approx(tiny_config.d_model ** -0.5, rel=0.1)
    assert np.std(tiny_params["block_0"]["mlp"]["gate"]) == pytest.approx(0.02, rel=0.1)
    np.testing.assert_array_equal(tiny_params["final_norm"]["scale"], 1.0)


def test_abstract_params_match_init(tiny_config, tiny_params):
    boxed = abstract_params(tiny_config)
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), nn.unbox(boxed))
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tiny_params)
    names = nn.get_partition_spec(boxed)
    assert tuple(names["embedding"]) == ("vocab", "embed")
    assert tuple(names["block_0"]["attn"]["query"]) == ("embed", "heads", "kv")
    assert tuple(names["block_0"]["attn"]["key"]) == ("embed", "kv_heads", "kv")
    assert tuple(names["block_0"]["attn"]["out"]) == ("heads", "kv", "embed")
    assert tuple(names["block_0"]["mlp"]["down"]) == ("mlp", "embed")
    assert tuple(names["block_0"]["norm"]["scale"]) == ("embed",)


def test_causal(tiny_config, tiny_params):
    forward = _forward(tiny_config)
    tokens = _tokens((1, 16))
    changed = tokens.copy()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    before = np.asarray(forward(tiny_params, tokens))
    after = np.asarray(forward(tiny_params, changed))
    assert before.shape == (1, 16, 256) and before.dtype == np.float32
    np.testing.assert_allclose(before[:, :10], after[:, :10], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, 10:], after[:, 10:], atol=1e-3)


def test_bfloat16_compute_gives_float32_logits(tiny_config, tiny_params):
    bf16 = dataclasses.replace(tiny_config, dtype="bfloat16", n_layers=1)
    f32 = dataclasses.replace(tiny_config, n_layers=1)
    params = {k: v for k, v in tiny_params.items() if k != "block_1"}
    tokens = _tokens((2, 8))
    low = np.asarray(_forward(bf16)(params, tokens))
    ref = np.asarray(_forward(f32)(params, tokens))
    assert low.dtype == np.float32
    np.testing.assert_allclose(low, ref, atol=0.1 * np.abs(ref).max())


def _constraint_count(config, params, tokens):
    text = _forward(config).lower(params, tokens).as_text()
    return text.count("sharding_constraint")


def test_activation_constraints_only_apply_under_rules(tiny_config, tiny_params):
    tokens = _tokens((2, 8))
    # Plain single-device use: constraints vanish (and apply works).
    assert _constraint_count(tiny_config, tiny_params, tokens) == 0
    # Rules without a mesh, or a mesh without rules: still harmless no-ops.
    with nn.logical_axis_rules(partitioning.logical_rules()):
        assert _constraint_count(tiny_config, tiny_params, tokens) == 0
    mesh = partitioning.make_mesh(2, 2)
    with jax.set_mesh(mesh):
        assert _constraint_count(tiny_config, tiny_params, tokens) == 0
    # Under activate_rules: embedding output, final norm (in and gathered), logits; per block the
    # input, norm output (in and gathered), q, ctx, mlp gate/up/hidden and the residual output.
    with partitioning.activate_rules(mesh):
        count = _constraint_count(tiny_config, tiny_params, tokens)
    assert count == 4 + 9 * tiny_config.n_layers
