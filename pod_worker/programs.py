"""The pure functions a pod compiles: gradient step, update step, evaluation.

They know nothing about meshes; PodTrainer jits them with the pod's shardings under
model.partitioning.activate_rules. Kept apart from the trainer's state handling so that the
within-pod techniques (microbatching, remat, sequence parallelism) change only this file and the
model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from model import ModelConfig, loss_sums


def make_grad_step(model_cfg: ModelConfig):
    """(params, tokens [b, T+1], normalizer) -> (grads, ce_sum, z_sum).

    The loss is divided by the *global* token count (normalizer), so the pods' gradients sum to
    the gradient of the global-batch mean loss.
    """
    def grad_step(params, tokens, normalizer):
        def loss_fn(p):
            ce, z = loss_sums(p, tokens, model_cfg)
            return (ce + z) / normalizer, (ce, z)
        (_, (ce, z)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, ce, z
    return grad_step


def make_apply_update(tx: optax.GradientTransformation):
    """(params, opt_state, summed_grads) -> (params, opt_state, grad_norm, finite).

    Clipping (inside tx) and skip-on-non-finite are decided from the summed gradient, so every
    pod, running this same program on the same bytes, decides the same.
    """
    def apply_update(params, opt_state, grads):
        norm = optax.global_norm(grads)
        finite = jnp.isfinite(norm)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)
        return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state), norm, finite
    return apply_update


def make_eval_step(model_cfg: ModelConfig):
    """(params, tokens) -> (ce_sum, z_sum)."""
    def eval_step(params, tokens):
        return loss_sums(params, tokens, model_cfg)
    return eval_step
