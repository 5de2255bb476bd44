"""layers.dense: the MLP's matmul, whose CPU backward pass takes the weight gradient from a
transposed copy of the activations so that XLA runs it on YNNPACK rather than Eigen."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multipod.model.layers import dense

# Big enough for YNNPACK (it declines matmuls whose dimensions are all under 8).
X_SHAPE, W_SHAPE = (2, 16, 32), (32, 48)


def _inputs(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(X_SHAPE), dtype=dtype)
    w = jnp.asarray(rng.standard_normal(W_SHAPE), dtype=dtype)
    g = jnp.asarray(rng.standard_normal(X_SHAPE[:-1] + W_SHAPE[-1:]), dtype=dtype)
    return x, w, g


def _vjp(matmul):
    def both(x, w, g):
        out, pull = jax.vjp(matmul, x, w)
        return (out, *pull(g))
    return jax.jit(both)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_and_its_gradients_equal_the_plain_matmul(dtype):
    x, w, g = _inputs(dtype)
    got = _vjp(dense)(x, w, g)
    want = _vjp(lambda a, b: a @ b)(x, w, g)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("output", "x gradient", "w gradient"), got, want):
        assert a.dtype == b.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=tolerance, atol=tolerance, err_msg=name)


def _entry_dots(matmul) -> list[str]:
    """The matmuls of the compiled backward pass that XLA left outside its YNNPACK fusions: a dot
    instruction in the entry computation runs on Eigen, one inside a fusion's computation does not."""
    hlo = _vjp(matmul).lower(*_inputs(jnp.float32)).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return re.findall(r"= f32\[[^\]]*\]\S* dot\(", entry)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the transposed copy is for XLA's CPU backend")
def test_on_cpu_no_matmul_of_dense_s_backward_is_left_to_eigen():
    # The plain matmul's weight gradient is the one XLA leaves out; if this stops holding, XLA now
    # takes it as it is and dense's copy is no longer needed.
    assert _entry_dots(lambda a, b: a @ b), "XLA now gives the plain weight gradient to YNNPACK"
    assert _entry_dots(dense) == []
