"""Next-token cross-entropy and PaLM's auxiliary z-loss."""
from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp

from multipod.model.config import ModelConfig
from multipod.model.transformer import Transformer


def token_losses(logits: jax.Array, targets: jax.Array,
                 z_loss_weight: float) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy [B, T] and z-loss z_loss_weight * logsumexp(logits)**2 [B, T].

    Computed in float32. The target logit is picked with a one-hot contraction rather
    than a gather so that vocab-sharded logits reduce locally and then across shards.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    target_logit = jnp.sum(logits * one_hot, axis=-1)
    ce = log_z - target_logit
    # z-loss keeps the softmax normaliser near 1 (log_z near 0) for stability (PaLM).
    z_loss = z_loss_weight * jnp.square(log_z)
    return ce, z_loss


def loss_sums(params, tokens: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(sum of cross-entropy, sum of z-loss) over all predicted tokens.

    tokens: int32 [B, T+1]; the model reads tokens[:, :-1] and predicts tokens[:, 1:].
    Sums (not means) so that callers can add them up across micro-batches and pods and
    divide by the global token count once.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # cast: flax types apply() as the output or an (output, variables) pair; without `mutable`
    # it is the output alone.
    logits = cast(jax.Array, Transformer(config).apply({"params": params}, inputs))
    ce, z_loss = token_losses(logits, targets, config.z_loss_weight)
    return jnp.sum(ce), jnp.sum(z_loss)


def prompted_loss_sums(params, prefix: jax.Array, tokens: jax.Array, loss_mask: jax.Array | None,
                       config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """loss_sums with N virtual-token embeddings prefix [N, d] before every row (prompt tuning),
    counting only the targets where loss_mask [B, T] is 1 (None: every target).

    tokens: int32 [B, T+1] as in loss_sums; the logits of the N virtual positions predict nothing.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = cast(jax.Array, Transformer(config).apply({"params": params}, inputs, prefix=prefix))[:, prefix.shape[0]:]
    ce, z_loss = token_losses(logits, targets, config.z_loss_weight)
    if loss_mask is not None:
        weight = loss_mask.astype(jnp.float32)
        ce, z_loss = ce * weight, z_loss * weight
    return jnp.sum(ce), jnp.sum(z_loss)
