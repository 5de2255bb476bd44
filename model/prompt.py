"""Prompt tuning and p-tuning: the trainable part of an adapted model.

The base Transformer stays frozen; what is trained produces N "virtual token" embeddings [N, d]
that Transformer.__call__ puts before every sequence (its `prefix`):
- "prompt" (Lester et al., 2021, "The Power of Scale for Parameter-Efficient Prompt Tuning"): the
  N embeddings themselves are the parameters. They start as the base's embeddings of N tokens
  drawn from its vocabulary (sampled_vocab_init), which that paper found to train better than a
  random start.
- "mlp" and "lstm" (Liu et al., 2021, "GPT Understands, Too": P-tuning): a prompt encoder
  produces them from N learned input embeddings: a two-layer MLP, or a bidirectional LSTM followed
  by that MLP, so the virtual tokens depend on each other.
"""
from __future__ import annotations

from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from multipod.model.config import PromptKind
from multipod.model.layers import declare_param


class PromptEncoder(nn.Module):
    """() -> float32 virtual-token embeddings [virtual_tokens, d_model].

    Param tree: {"virtual"} for "prompt"; plus {"hidden", "out"} (the MLP) for "mlp"; plus
    {"lstm_forward", "lstm_backward"} before it for "lstm"."""

    kind: PromptKind
    virtual_tokens: int
    d_model: int
    hidden: int

    @nn.compact
    def __call__(self) -> jax.Array:
        # The base embedding's own scale (model/transformer.py), so the virtual tokens start like tokens.
        init = nn.initializers.normal(self.d_model ** -0.5)
        virtual = declare_param(self, "virtual", init, (self.virtual_tokens, self.d_model), jnp.float32)
        if self.kind == "prompt":
            return virtual
        x = virtual
        if self.kind == "lstm":
            half = max(1, self.hidden // 2)
            lstm = nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(half, name="lstm_forward")),
                                    nn.RNN(nn.OptimizedLSTMCell(half, name="lstm_backward")))
            x = lstm(x[None])[0]
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(self.d_model, name="out")(x)


def init_prompt(kind: PromptKind | str, virtual_tokens: int, d_model: int, hidden: int, seed: int) -> dict:
    """The encoder's initial parameters, a function of `seed` only (for "prompt", replace
    "virtual" with sampled_vocab_init once the base is known). ValueError for an unknown kind."""
    encoder = PromptEncoder(PromptKind(kind), virtual_tokens, d_model, hidden)
    return encoder.init(jax.random.PRNGKey(seed))["params"]


def sampled_vocab_init(embedding: jax.Array, virtual_tokens: int, seed: int) -> jax.Array:
    """float32 [virtual_tokens, d]: the base embedding's rows of tokens drawn uniformly from its
    vocabulary with `seed`."""
    ids = jax.random.randint(jax.random.PRNGKey(seed), (virtual_tokens,), 0, embedding.shape[0])
    return jnp.take(embedding, ids, axis=0).astype(jnp.float32)


def prompt_embeddings(prompt_params: dict, kind: PromptKind, d_model: int, hidden: int) -> jax.Array:
    """The virtual-token embeddings [N, d] the encoder makes of `prompt_params`."""
    virtual_tokens = prompt_params["virtual"].shape[0]
    # cast: flax types apply() as the output or an (output, variables) pair; without `mutable`
    # it is the output alone.
    return cast(jax.Array, PromptEncoder(kind, virtual_tokens, d_model, hidden).apply({"params": prompt_params}))
