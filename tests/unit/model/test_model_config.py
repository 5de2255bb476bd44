"""ModelConfig validation and the derived parameter/FLOP counts."""
import dataclasses

import jax
import numpy as np
import pytest

from multipod.model import ConfigError, ModelConfig, init_params

TINY = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=64, max_seq_len=16)


def test_default_and_tiny_configs_validate():
    ModelConfig().validate()
    TINY.validate()


@pytest.mark.parametrize("field, value", [
    ("vocab_size", 0),
    ("d_model", -4),
    ("n_layers", 0),
    ("n_heads", 0),
    ("head_dim", 0),
    ("mlp_dim", -1),
    ("max_seq_len", 0),
    ("d_model", 32.0),
    ("n_layers", True),
    ("head_dim", 7),
    ("init_std", 0.0),
    ("rope_base", -1.0),
    ("z_loss_weight", -1e-4),
    ("dtype", "float16"),
    ("param_dtype", "fp32"),
])
def test_validate_names_bad_field(field, value):
    config = dataclasses.replace(TINY, **{field: value})
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert err.value.field == f"model.{field}"
    assert str(err.value).startswith(f"model.{field}: ")


def test_kv_heads_must_divide_heads():
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(TINY, n_heads=4, n_kv_heads=3).validate()
    assert err.value.field == "model.n_kv_heads"
    dataclasses.replace(TINY, n_heads=4, n_kv_heads=2).validate()


def test_config_error_is_value_error():
    assert isinstance(ConfigError("model.x", "bad"), ValueError)
    assert str(ConfigError("model.x", "bad")) == "model.x: bad"


def _size(params):
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))


def test_param_count_matches_tiny_param_tree(tiny_config, tiny_params):
    assert tiny_config.param_count() == _size(tiny_params)


# One layer each: every random init is a separate XLA computation, slow to compile on CPU.
@pytest.mark.parametrize("overrides", [
    dict(n_kv_heads=2, vocab_size=100, mlp_dim=48, n_layers=1),
    dict(n_kv_heads=4, head_dim=6, d_model=24, n_layers=1),
])
def test_param_count_matches_param_tree(overrides):
    config = dataclasses.replace(TINY, **overrides)
    assert config.param_count() == _size(init_params(config, seed=0))


def test_flops_per_token_formula():
    c = dataclasses.replace(TINY, n_kv_heads=2)
    d, l, h, q, kv, m, v = 32, 2, 4, 8, 2, 64, 256
    n = v * d + l * (d + d * h * q + 2 * d * kv * q + h * q * d + 3 * d * m) + d
    assert c.param_count() == n
    assert c.flops_per_token(16) == pytest.approx(6 * n + 12 * l * h * q * 16)
    assert c.flops_per_token(32) - c.flops_per_token(16) == pytest.approx(12 * l * h * q * 16)
