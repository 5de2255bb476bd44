"""The decoder-only PaLM-style Transformer and its parameter initialisation."""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from multipod.model.config import ModelConfig
from multipod.model.layers import GATHERED, LOGITS, RESIDUAL, ParallelBlock, RMSNorm, constrain, remat_policy

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
        embedding = self.param("embedding", init, (c.vocab_size, c.d_model), c.weight_dtype, unbox=True)
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


def _boxed_shell_init(config: ModelConfig, key: jax.Array):
    """The parameters outside the blocks ({"embedding", "final_norm"}), boxed: the model's own
    init without its blocks, so with the values the whole model's init gives them."""
    return _boxed_init(dataclasses.replace(config, n_layers=0), key)


def _boxed_block_init(config: ModelConfig, key: jax.Array, index: jax.Array):
    """One block's parameters, boxed, from the model's key and the block's index (an argument, not
    a constant: one program initialises every block)."""
    x = jnp.zeros((*_INIT_TOKENS_SHAPE, config.d_model), config.compute_dtype)
    return block_class(config)(config).init(jax.random.fold_in(key, index), x)["params"]


def _init_options() -> dict | None:
    # On CPU, LLVM-optimising the unrolled threefry rounds of every initializer costs compile time
    # for no benefit (the init runs once per worker start), so it is skipped there. Values stay a
    # deterministic function of the seed for a given jax version and backend.
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


@functools.lru_cache(maxsize=16)
def _jitted_init(config: ModelConfig, sharding_treedef, sharding_leaves):
    """(the shell's program, the blocks' program), laid out by the shardings if given. Cached
    (keyed on the flattened, hashable shardings) so repeated init_params calls for one config and
    layout compile once."""
    shell_shardings = block_shardings = None
    if sharding_treedef is not None:
        # jit's out_shardings must match each program's boxed output (unboxed after the call,
        # which moves no data). Every block has the same logical axes: block_0's layout is each's.
        boxed = abstract_params(config)
        if jax.tree_util.tree_structure(_values(boxed)) != sharding_treedef:
            raise ValueError("init_params: `shardings` must have the parameter tree's structure")
        shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(boxed), sharding_leaves)
        shell_shardings = {name: shardings[name] for name in ("embedding", "final_norm")}
        block_shardings = shardings["block_0"]
    options = _init_options()
    return (jax.jit(functools.partial(_boxed_shell_init, config), out_shardings=shell_shardings,
                    compiler_options=options),
            jax.jit(functools.partial(_boxed_block_init, config), out_shardings=block_shardings,
                    compiler_options=options))


def init_params(config: ModelConfig, seed: int, shardings=None) -> dict:
    """Unboxed param tree (plain arrays), a deterministic function of `seed` only.

    Two programs, whatever the depth: the embedding and the final norm (the values the whole
    model's init gives them), and one block's parameters, run once per block with the block's
    index folded into the key. One program of the whole model's init held a random generator per
    parameter of every block: on CPU its compile grew to ~10 s at 16 layers, and its load from the
    compilation cache at every worker start to ~1.8 s.

    `shardings` (optional, e.g. from `partitioning.param_shardings`) makes jit create
    each parameter directly in its sharded layout; values are bitwise the same as the
    unsharded init because jax's threefry RNG is partitionable.
    """
    config.validate()
    treedef: jax.tree_util.PyTreeDef | None = None
    leaves: list = []
    if shardings is not None:
        leaves, treedef = jax.tree_util.tree_flatten(shardings)
    shell, block = _jitted_init(config, treedef, tuple(leaves))
    key = jax.random.PRNGKey(seed)
    params = dict(_values(shell(key)))
    for i in range(config.n_layers):
        params[f"block_{i}"] = _values(block(key, np.int32(i)))
    return params


@functools.lru_cache(maxsize=16)
def abstract_params(config: ModelConfig):
    """Shapes/dtypes of the boxed param tree (nn.Partitioned leaves), without compute.

    Feed this to `partitioning.param_shardings`. Cached per config: a worker asks for it from its
    trainer, the overlapped step and generation, and each call would trace the model's init again
    (treat the result as read-only).
    """
    config.validate()
    return jax.eval_shape(_init_fn(config), jax.random.PRNGKey(0))
