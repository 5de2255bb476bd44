"""Building blocks of the PaLM-style Transformer: RMSNorm, RoPE, attention, SwiGLU MLP.

No biases anywhere. Every parameter carries logical axis names and key activations carry
logical sharding constraints; both resolve to mesh axes only under
`partitioning.activate_rules`, and are no-ops otherwise. Nothing here knows about meshes.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.errors import ScopeParamShapeError
from jax.ad_checkpoint import checkpoint_name

from multipod.model.config import ModelConfig

# Logical names of activations (see partitioning.logical_rules for their mesh mapping).
# RESIDUAL is the region tensor parallelism leaves replicated (residual stream, norms); its
# sequence axis is split over `model` under sequence parallelism. GATHERED is the same tensor
# with the whole sequence: the input of the column-parallel matmuls.
RESIDUAL = ("batch", "residual_length", "embed")
GATHERED = ("batch", "length", "embed")
HEADS = ("batch", "length", "heads", "kv")
MLP_HIDDEN = ("batch", "length", "mlp")
LOGITS = ("batch", "length", "vocab")
# A layer's K or V cache for decoding [batch, max_len, kv_heads, head_dim]: laid out as the K/V
# activations of training (batch over `data`, K/V heads replicated).
CACHE = ("batch", "length", "kv_heads", "kv")

# Named matmul outputs. Selective recomputation keeps exactly these and recomputes the rest of a
# block (norm, RoPE, attention scores and softmax, SwiGLU's elementwise product) in the backward
# pass: the recomputed parts are cheap in FLOPs, while the scores/probabilities [b, h, T, T] are
# what dominates activation memory.
SAVED_BY_SELECTIVE = ("query_proj", "key_proj", "value_proj", "attention_context", "attention_out",
                      "mlp_gate", "mlp_up", "mlp_out")


def remat_policy(name: str):
    """The jax.checkpoint policy of a ModelConfig.remat value (None for "none" and "full").

    "full" keeps nothing inside a block (only its input, which the remat boundary saves);
    "selective" keeps the named matmul outputs in SAVED_BY_SELECTIVE.
    """
    if name == "selective":
        return jax.checkpoint_policies.save_only_these_names(*SAVED_BY_SELECTIVE)
    if name in ("none", "full"):
        return None
    raise ValueError(f"unknown remat policy {name!r}")


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Logical sharding constraint; a no-op outside `activate_rules`."""
    return nn.with_logical_constraint(x, names)


def declare_param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype) -> jax.Array:
    """`module.param(name, init, shape, dtype, unbox=True)`, minus flax's check on apply.

    When the parameter exists (apply: every traced step, evaluation, prefill and decode), flax
    re-derives its expected shape with `jax.eval_shape` of the initialiser, a trace of its own:
    about 7 ms per parameter, a quarter of tracing the tiny model's gradient step. The shape is
    known here, so it is compared directly; the traced program is the same. At init, flax's own
    `param` creates it (and reserves the name)."""
    shape = tuple(shape)
    if module.has_variable("params", name):
        value = meta.unbox(module.get_variable("params", name))
        if tuple(value.shape) != shape:
            path = module.scope.path_text if module.scope is not None else "/"
            raise ScopeParamShapeError(name, path, tuple(value.shape), shape)
        return value
    return module.param(name, init, shape, dtype, unbox=True)


def _param(module: nn.Module, name: str, shape, names, std: float, config: ModelConfig):
    """A normal(std)-initialised weight annotated with logical axis names."""
    init = nn.with_logical_partitioning(nn.initializers.normal(std), names)
    return declare_param(module, name, init, shape, config.weight_dtype).astype(config.compute_dtype)


class RMSNorm(nn.Module):
    """RMS normalisation with a learned scale and no bias (PaLM drops all biases).

    Chosen over bias-free LayerNorm for simplicity; statistics are taken in float32.
    """

    config: ModelConfig
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        scale = declare_param(self, "scale", init, (x.shape[-1],), self.config.weight_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.config.compute_dtype)


def apply_rope(x: jax.Array, base: float, start: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on x [batch, length, heads, head_dim].

    Positions are 0..T-1, or with `start` (int32 [batch], decoding with a KV cache) start[b] + 0..T-1
    for row b. Uses the "rotate half" pairing (feature i with i + head_dim/2); angles in float32.
    """
    length, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if start is None:
        angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        sin = jnp.sin(angles)[None, :, None, :]
        cos = jnp.cos(angles)[None, :, None, :]
    else:
        positions = (start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]).astype(jnp.float32)
        angles = positions[:, :, None] * inv_freq[None, None, :]
        sin = jnp.sin(angles)[:, :, None, :]
        cos = jnp.cos(angles)[:, :, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def write_cache(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [batch, max_len, ...] with new [batch, T, ...] written at rows b's positions
    start[b] .. start[b] + T - 1 (the caller keeps start[b] + T <= max_len)."""
    write = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0)
    return constrain(jax.vmap(write)(cache, new, start), CACHE)


class Attention(nn.Module):
    """Causal multi-query / grouped-query attention with RoPE.

    n_kv_heads K/V heads are shared by groups of n_heads // n_kv_heads query heads
    (query head h uses K/V head h // group).

    Training calls it on a whole sequence. Decoding (model/decode.py) passes `cache`, this layer's
    {"key", "value"} arrays [batch, max_len, kv_heads, head_dim], and `start` (int32 [batch]): row b
    of x holds the tokens at positions start[b] ..; their K/V are written into the cache there,
    the queries attend to every cached position up to their own, and the call returns
    (output, updated cache). The projections, RoPE and the attention itself are the same code.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, cache: dict | None = None, start: jax.Array | None = None):
        c = self.config
        d, h, k, q_dim = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        wq = _param(self, "query", (d, h, q_dim), ("embed", "heads", "kv"), c.init_std, c)
        wk = _param(self, "key", (d, k, q_dim), ("embed", "kv_heads", "kv"), c.init_std, c)
        wv = _param(self, "value", (d, k, q_dim), ("embed", "kv_heads", "kv"), c.init_std, c)
        wo = _param(self, "out", (h, q_dim, d), ("heads", "kv", "embed"), c.init_std, c)

        q = checkpoint_name(constrain(jnp.einsum("btd,dhq->bthq", x, wq), HEADS), "query_proj")
        key = checkpoint_name(jnp.einsum("btd,dkq->btkq", x, wk), "key_proj")
        value = checkpoint_name(jnp.einsum("btd,dkq->btkq", x, wv), "value_proj")
        q = apply_rope(q, c.rope_base, start) * (q_dim ** -0.5)
        key = apply_rope(key, c.rope_base, start)

        batch, length = x.shape[:2]
        if cache is None:
            visible = jnp.tril(jnp.ones((length, length), dtype=bool))
        elif start is None:
            raise ValueError("attention with a cache needs `start`, each row's first position")
        else:
            cache = {"key": write_cache(cache["key"], key, start), "value": write_cache(cache["value"], value, start)}
            key, value = cache["key"].astype(key.dtype), cache["value"].astype(value.dtype)
            # Query t of row b sits at position start[b] + t and sees the cached positions up to it
            # (what lies beyond, e.g. a shorter prompt's padding, is overwritten before it is seen).
            query_pos = start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
            visible = jnp.arange(key.shape[1], dtype=jnp.int32)[None, None, :] <= query_pos[:, :, None]
            visible = visible[:, None, None]    # [b, 1, 1, t, s] against scores [b, k, g, t, s]
        q = q.reshape(batch, length, k, h // k, q_dim)
        scores = jnp.einsum("btkgq,bskq->bkgts", q, key, preferred_element_type=jnp.float32)
        # The diagonal is always visible, so no row is fully masked and softmax stays finite.
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(c.compute_dtype)
        ctx = jnp.einsum("bkgts,bskq->btkgq", probs, value).reshape(batch, length, h, q_dim)
        ctx = checkpoint_name(constrain(ctx, HEADS), "attention_context")
        out = checkpoint_name(jnp.einsum("bthq,hqd->btd", ctx, wo), "attention_out")
        return out if cache is None else (out, cache)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., d] @ w [d, f]: the MLP's matmuls.

    On CPU its backward pass computes the weight gradient from a transposed copy of x. XLA's CPU
    backend hands a matmul to its fast kernels (YNNPACK) only when both operands are row-major
    with the contracted axis of the left one last; left alone, it contracts the weight gradient
    over the token axis of x in place, and Eigen runs those at about half the rate (measured:
    the forward and backward pass of a 4-layer d=256 model 11% shorter with the copy,
    bench/mlp_grad.py, docs/benchmarks.md). Other backends choose their own layouts, so they get
    the plain matmul.
    """
    if jax.default_backend() == "cpu":
        return _dense_transposed_grad(x, w)
    return x @ w


@jax.custom_vjp
def _dense_transposed_grad(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _dense_forward(x: jax.Array, w: jax.Array):
    return x @ w, (x, w)


def _dense_backward(saved, grad):
    x, w = saved
    # The barrier keeps XLA from folding the transpose back into the matmul's dimension numbers.
    x_t = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
    w_grad = x_t @ grad.reshape(-1, grad.shape[-1])
    return (grad @ w.T).astype(x.dtype), w_grad.astype(w.dtype)


_dense_transposed_grad.defvjp(_dense_forward, _dense_backward)


class SwiGLU(nn.Module):
    """MLP with SwiGLU activation: down(silu(gate(x)) * up(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        gate = _param(self, "gate", (c.d_model, c.mlp_dim), ("embed", "mlp"), c.init_std, c)
        up = _param(self, "up", (c.d_model, c.mlp_dim), ("embed", "mlp"), c.init_std, c)
        down = _param(self, "down", (c.mlp_dim, c.d_model), ("mlp", "embed"), c.init_std, c)
        gated = checkpoint_name(constrain(dense(x, gate), MLP_HIDDEN), "mlp_gate")
        linear = checkpoint_name(constrain(dense(x, up), MLP_HIDDEN), "mlp_up")
        hidden = constrain(jax.nn.silu(gated) * linear, MLP_HIDDEN)
        return checkpoint_name(dense(hidden, down), "mlp_out")


class ParallelBlock(nn.Module):
    """PaLM parallel block: x + attn(norm(x)) + mlp(norm(x)), one shared pre-norm.

    The norm runs on RESIDUAL (sequence-split under sequence parallelism); its output is
    gathered to the whole sequence for the matmuls, and the block's output is constrained back
    to RESIDUAL, which turns the row-parallel partial sums into a reduce-scatter. With `cache`
    and `start` (decoding: see Attention) it returns (output, the attention's updated cache).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, cache: dict | None = None, start: jax.Array | None = None):
        h = constrain(RMSNorm(self.config, name="norm")(constrain(x, RESIDUAL)), RESIDUAL)
        h = constrain(h, GATHERED)
        attn = Attention(self.config, name="attn")
        if cache is None:
            x = x + attn(h) + SwiGLU(self.config, name="mlp")(h)
            return constrain(x, RESIDUAL)
        attended, cache = attn(h, cache, start)
        x = x + attended + SwiGLU(self.config, name="mlp")(h)
        return constrain(x, RESIDUAL), cache
