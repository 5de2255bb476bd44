"""layers.declare_param: a parameter that exists is read as it is, its shape checked against the
declared one, without tracing its initialiser again (flax's own `param` traces it on every
apply); at init the initialiser makes it, with its logical axis names."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.errors import ScopeCollectionNotFound, ScopeParamNotFoundError, ScopeParamShapeError

from multipod.model.layers import declare_param

CALLS: list = []     # the initialiser's calls (a module's own list attribute would be frozen)


def _ones(key, shape, dtype):
    CALLS.append(shape)
    return jnp.ones(shape, dtype)


class _Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = _ones
        w = declare_param(self, "w", nn.with_logical_partitioning(init, ("embed", "mlp")), (3, 4), jnp.float32)
        return x @ w


def test_the_initialiser_runs_at_init_only():
    CALLS.clear()
    calls, module = CALLS, _Counted()
    variables = module.init(jax.random.key(0), jnp.ones((2, 3)))
    assert calls == [(3, 4)]
    assert isinstance(variables["params"]["w"], nn.LogicallyPartitioned)
    assert variables["params"]["w"].names == ("embed", "mlp")
    params = nn.unbox(variables)
    out = jax.jit(module.apply)(params, jnp.ones((2, 3)))
    assert calls == [(3, 4)], "apply traced the initialiser again"
    assert out.tolist() == [[3.0] * 4] * 2
    # Boxed parameters (as init returns them) read the same.
    assert module.apply(variables, jnp.ones((2, 3))).tolist() == out.tolist()


def test_a_parameter_of_another_shape_is_refused_naming_it():
    module = _Counted()
    with pytest.raises(ScopeParamShapeError, match=r'"w".*expected.*\(3, 4\).*has shape \(3, 5\)'):
        module.apply({"params": {"w": jnp.ones((3, 5))}}, jnp.ones((2, 3)))


def test_a_missing_parameter_is_refused_at_apply_naming_it():
    with pytest.raises(ScopeParamNotFoundError, match='parameter named "w"'):
        _Counted().apply({"params": {"other": jnp.ones(3)}}, jnp.ones((2, 3)))
    with pytest.raises(ScopeCollectionNotFound, match='"w" from collection "params"'):
        _Counted().apply({"params": {}}, jnp.ones((2, 3)))
