"""Cross-entropy / z-loss against numpy references."""
import jax
import jax.numpy as jnp
import numpy as np

from multipod.model import Transformer, loss_sums, token_losses


def _np_logsumexp(x):
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def test_token_losses_match_numpy():
    rng = np.random.RandomState(0)
    logits = (rng.randn(2, 5, 11) * 3).astype(np.float32)
    targets = rng.randint(0, 11, size=(2, 5)).astype(np.int32)
    ce, z = token_losses(logits, targets, 1e-2)
    lse = _np_logsumexp(logits.astype(np.float64))
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    assert ce.shape == z.shape == (2, 5)
    assert ce.dtype == z.dtype == np.float32
    np.testing.assert_allclose(ce, lse - picked, rtol=1e-5)
    np.testing.assert_allclose(z, 1e-2 * lse ** 2, rtol=1e-5)


def test_token_losses_upcast_bfloat16():
    logits = np.random.RandomState(1).randn(1, 3, 7).astype(np.float32)
    ce, z = token_losses(jnp.asarray(logits, jnp.bfloat16), np.zeros((1, 3), np.int32), 1.0)
    assert ce.dtype == z.dtype == np.float32


def test_loss_sums_shift_targets(tiny_config, tiny_params):
    tokens = np.random.RandomState(2).randint(0, 256, size=(2, 9)).astype(np.int32)
    ce_sum, z_sum = jax.jit(loss_sums, static_argnums=2)(tiny_params, tokens, tiny_config)
    forward = jax.jit(lambda p, t: Transformer(tiny_config).apply({"params": p}, t))
    logits = np.asarray(forward(tiny_params, tokens[:, :-1]), dtype=np.float64)
    lse = _np_logsumexp(logits)
    picked = np.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(ce_sum, (lse - picked).sum(), rtol=1e-5)
    np.testing.assert_allclose(z_sum, tiny_config.z_loss_weight * (lse ** 2).sum(), rtol=1e-5)
