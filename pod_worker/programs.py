"""The pure functions a pod compiles: gradient step, update step, evaluation.

They know nothing about meshes; PodTrainer jits them with the pod's shardings under
model.partitioning.activate_rules. Kept apart from the trainer's state handling so that the
within-pod techniques (microbatching, remat, sequence parallelism) change only this file and the
model.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from multipod.model import ConfigError, ModelConfig, loss_sums
from multipod.model.partitioning import rules_for


def check_microbatches(rows: int, k: int) -> None:
    """ConfigError unless k microbatches split a pod's batch of `rows` sequences evenly."""
    if rows % k:
        raise ConfigError("model.microbatches", f"{k} does not divide the pod's batch of {rows} sequences")


def split_microbatches(tokens: jax.Array, k: int) -> jax.Array:
    """[b, T+1] -> [k, b/k, T+1]; microbatch i holds rows i, i+k, i+2k, ...

    Strided rather than contiguous so that, with the batch split over the `data` axis in
    contiguous blocks, every device keeps its own rows in every microbatch (no data moves).
    """
    rows = tokens.shape[0]
    check_microbatches(rows, k)
    micro = tokens.reshape(rows // k, k, tokens.shape[1]).swapaxes(0, 1)
    return nn.with_logical_constraint(micro, (None, "batch", "length"))


def make_grad_step(model_cfg: ModelConfig):
    """(params, tokens [b, T+1], normalizer) -> (grads, ce_sum, z_sum).

    The loss is divided by the *global* token count (normalizer), so the pods' gradients sum to
    the gradient of the global-batch mean loss. With model_cfg.microbatches = k > 1 the shard is
    split into k microbatches (split_microbatches) that run one after another inside this one
    program (a scan), accumulating gradients and loss sums in float32: peak activation memory is
    that of b/k sequences. The result equals the unsplit step to float tolerance (only the order
    of the sums differs), and is still one deterministic program, so pods stay bitwise identical.
    The sequence-parallel rules (model_cfg.sequence_parallel) are entered here, at trace time.
    """
    k = model_cfg.microbatches

    def value_and_grad(params, tokens, normalizer):
        def loss_fn(p):
            ce, z = loss_sums(p, tokens, model_cfg)
            return (ce + z) / normalizer, (ce, z)
        (_, (ce, z)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, ce, z

    def grad_step(params, tokens, normalizer):
        with rules_for(model_cfg):
            if k == 1:
                return value_and_grad(params, tokens, normalizer)
            micro = split_microbatches(tokens, k)

            def accumulate(carry, batch):
                grads, ce, z = value_and_grad(params, batch, normalizer)
                add = lambda a, b: a + b.astype(a.dtype)
                return jax.tree.map(add, carry, (grads, ce, z)), None

            zeros = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                     jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (grads, ce, z), _ = jax.lax.scan(accumulate, zeros, micro)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
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
        with rules_for(model_cfg):
            return loss_sums(params, tokens, model_cfg)
    return eval_step


def memory_stats(compiled) -> dict:
    """Per-device bytes of a compiled program, from XLA's memory analysis.

    peak_bytes = arguments + outputs + temporaries - aliased (donated inputs reused as outputs):
    what one device must hold while the program runs. Values are None where the backend gives no
    analysis.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {"argument_bytes": None, "output_bytes": None, "temp_bytes": None, "peak_bytes": None}
    args, outs = int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes)
    temp, alias = int(analysis.temp_size_in_bytes), int(analysis.alias_size_in_bytes)
    return {"argument_bytes": args, "output_bytes": outs, "temp_bytes": temp,
            "peak_bytes": args + outs + temp - alias}


def program_flops(compiled, loop_trips: int = 1) -> float | None:
    """FLOPs one device executes in one run of a compiled program, from XLA's cost analysis.

    This is hardware FLOPs: whatever the program really computes, recomputation included.
    XLA's cost analysis counts a while loop's body once, so for the microbatch scan (the only
    loop in the step programs, around nearly all of the work) the caller passes its trip count.
    None if the backend gives no analysis.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax returned one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"]) * loop_trips
