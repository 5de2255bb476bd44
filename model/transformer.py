"""The decoder-only PaLM-style Transformer and its parameter initialisation."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from multipod.model.config import ModelConfig
from multipod.model.layers import (
    GATHERED,
    LOGITS,
    RESIDUAL,
    ParallelBlock,
    RMSNorm,
    constrain,
    declare_param,
    remat_policy,
)

# Shape of the dummy input used to create parameters; no parameter depends on it.
_INIT_TOKENS_SHAPE = (1, 1)


class Transformer(nn.Module):
    """Decoder-only LM: shared in/out embedding, parallel blocks, final RMSNorm.

    Param tree: {"embedding", "block_0" ... "block_{L-1}", "final_norm"}.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, cache: list | None = None, start: jax.Array | None = None,
                 prefix: jax.Array | None = None):
        """int32 tokens [B, T] -> float32 logits [B, T, vocab].

        Decoding (model/decode.py): with `cache` (one {"key", "value"} per block, each
        [B, max_len, kv_heads, head_dim]) and `start` (int32 [B]: row b's tokens sit at positions
        start[b] ..), returns (logits, updated cache). Same parameters, same code as training.

        prefix (prompt tuning, model/prompt.py): embeddings [N, d] of N virtual tokens put before
        every row's tokens (positions 0..N-1); the logits then cover N + T positions.
        """
        c = self.config
        # Logits are scaled by 1/sqrt(d_model) as in PaLM. With a shared matrix a token's own
        # logit is ~ |e|^2 / (sigma sqrt(d_model)), so PaLM's sigma = 1 would start with a large
        # "repeat the input" bias (initial loss 12 for d=256) and make Adam's absolute steps tiny
        # relative to the embedding. sigma = 1/sqrt(d_model) keeps that logit O(1).
        init = nn.with_logical_partitioning(nn.initializers.normal(c.d_model ** -0.5), ("vocab", "embed"))
        embedding = declare_param(self, "embedding", init, (c.vocab_size, c.d_model), c.weight_dtype)
        embedding = embedding.astype(c.compute_dtype)

        x = embed_tokens(embedding, tokens)
        if prefix is not None:
            virtual = jnp.broadcast_to(prefix.astype(x.dtype)[None], (x.shape[0], *prefix.shape))
            x = constrain(jnp.concatenate([virtual, x], axis=1), RESIDUAL)
        block = block_class(c)
        updated = []
        for i in range(c.n_layers):
            if cache is None:
                x = block(c, name=f"block_{i}")(x)
            else:
                x, layer_cache = block(c, name=f"block_{i}")(x, cache[i], start)
                updated.append(layer_cache)
        x = constrain(RMSNorm(c, name="final_norm")(x), RESIDUAL)
        logits = unembed(x, embedding, c)
        return logits if cache is None else (logits, updated)


# The pieces of Transformer.__call__ outside its sub-modules, as pure functions, so that a caller
# can also run the model one part at a time (pod_worker/overlap.py: one program per block).
def block_class(config: ModelConfig) -> type[nn.Module]:
    """The block module: ParallelBlock, or with config.remat != "none" ParallelBlock as one remat
    region (same parameter names)."""
    if config.remat == "none":
        return ParallelBlock
    return nn.remat(ParallelBlock, policy=remat_policy(config.remat))


def embed_tokens(embedding: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32 tokens [B, T] -> residual stream [B, T, d] (embedding already in the compute dtype)."""
    return constrain(jnp.take(embedding, tokens, axis=0), RESIDUAL)


def unembed(x: jax.Array, embedding: jax.Array, config: ModelConfig) -> jax.Array:
    """Final-normed residual stream [B, T, d] -> float32 logits [B, T, vocab], through the shared
    embedding (in the compute dtype), scaled by 1/sqrt(d_model)."""
    x = constrain(x, GATHERED)
    logits = jnp.einsum("btd,vd->btv", x, embedding, preferred_element_type=jnp.float32)
    logits = logits * (config.d_model ** -0.5)
    return constrain(logits, LOGITS)


def _boxed_init(config: ModelConfig, key: jax.Array):
    """Params with nn.Partitioned leaves (logical axis names attached)."""
    tokens = jnp.zeros(_INIT_TOKENS_SHAPE, jnp.int32)
    return Transformer(config).init(key, tokens)["params"]


def _values(boxed):
    """The plain tree of a boxed one (each nn.Partitioned's value). Not nn.unbox, which also
    constrains each value's sharding: jit's out_shardings has placed them already."""
    return jax.tree_util.tree_map(lambda leaf: leaf.value, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


@functools.lru_cache(maxsize=16)
def _init_fn(config: ModelConfig):
    """The boxed init of `config`, one function object per config: jax caches a trace on the
    function, so abstract_params' eval_shape and init_params' jit (whatever its out_shardings)
    trace the model's init once between them, not twice."""
    return functools.partial(_boxed_init, config)


@functools.lru_cache(maxsize=16)
def _jitted_init(config: ModelConfig, sharding_treedef, sharding_leaves):
    # Cached (keyed on the flattened, hashable shardings) so repeated init_params calls
    # for one config and layout compile once.
    shardings = None
    if sharding_treedef is not None:
        # The boxed tree's structure with the shardings as leaves: jit's out_shardings must match
        # the boxed output (unboxed after the call, which moves no data).
        boxed = abstract_params(config)
        if jax.tree_util.tree_structure(_values(boxed)) != sharding_treedef:
            raise ValueError("init_params: `shardings` must have the parameter tree's structure")
        shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(boxed), sharding_leaves)
    # On CPU, LLVM-optimising the unrolled threefry rounds of every initializer costs
    # ~0.5 s of compile per parameter for no benefit (init runs once), so skip it there.
    # Values stay a deterministic function of the seed for a given jax version/backend.
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    return jax.jit(_init_fn(config), out_shardings=shardings, compiler_options=options)


def init_params(config: ModelConfig, seed: int, shardings=None) -> dict:
    """Unboxed param tree (plain arrays), a deterministic function of `seed` only.

    `shardings` (optional, e.g. from `partitioning.param_shardings`) makes jit create
    each parameter directly in its sharded layout; values are bitwise the same as the
    unsharded init because jax's threefry RNG is partitionable.
    """
    config.validate()
    treedef: jax.tree_util.PyTreeDef | None = None
    leaves: list = []
    if shardings is not None:
        leaves, treedef = jax.tree_util.tree_flatten(shardings)
    return _values(_jitted_init(config, treedef, tuple(leaves))(jax.random.PRNGKey(seed)))


@functools.lru_cache(maxsize=16)
def abstract_params(config: ModelConfig):
    """Shapes/dtypes of the boxed param tree (nn.Partitioned leaves), without compute.

    Feed this to `partitioning.param_shardings`. Cached per config: a worker asks for it from its
    trainer, the overlapped step and generation, and each call would trace the model's init again
    (treat the result as read-only).
    """
    config.validate()
    return jax.eval_shape(_init_fn(config), jax.random.PRNGKey(0))
