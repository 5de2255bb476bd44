"""The update's maths: AdamW after global-norm clipping on a warmup + cosine schedule, and how its
state is laid out over a pod's mesh. Every pod builds the same optimizer from the same config."""
from __future__ import annotations

import functools

import jax
import optax

from multipod.pod_worker.schema import LrSchedule, OptimizerConfig


@functools.lru_cache(maxsize=16)
def make_schedule(opt: OptimizerConfig, schedule_steps: int):
    """Linear warmup to the peak learning rate, then (optimizer.schedule) cosine decay over
    schedule_steps to min_lr_ratio of it, or the peak held until OptimizerConfig.decay_start and a
    linear decay to min_lr_ratio of it at schedule_steps (warmup-stable-decay). Either holds its
    final rate after schedule_steps."""
    end = opt.learning_rate * opt.min_lr_ratio
    if opt.schedule is LrSchedule.COSINE:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=opt.learning_rate, warmup_steps=opt.warmup_steps,
            decay_steps=max(schedule_steps, opt.warmup_steps + 1), end_value=end)
    start = opt.decay_start(schedule_steps)
    parts = [optax.linear_schedule(0.0, opt.learning_rate, opt.warmup_steps),
             optax.constant_schedule(opt.learning_rate)]
    if schedule_steps > start:      # decay_fraction 0 (or no steps left after the warmup): no decay
        parts.append(optax.linear_schedule(opt.learning_rate, end, schedule_steps - start))
    return optax.join_schedules(parts, [opt.warmup_steps, start][:len(parts) - 1])


@functools.lru_cache(maxsize=16)
def make_optimizer(opt: OptimizerConfig, schedule_steps: int) -> optax.GradientTransformation:
    """AdamW (no weight decay on 1-d params such as norm scales), after global-norm clipping.
    Memoised (as programs.py's builders): trainers of the same config share its functions, so jax
    traces its init and update once per process."""
    parts = []
    if opt.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(opt.clip_norm))
    parts.append(optax.adamw(make_schedule(opt, schedule_steps), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                             weight_decay=opt.weight_decay,
                             mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)))
    return optax.chain(*parts)


def opt_shardings(opt_abstract, param_sharding, scalar_sharding):
    """The shardings of an optimizer state shaped `opt_abstract` over parameters laid out by
    `param_sharding`: a per-parameter leaf takes its parameter's, the rest (e.g. AdamW's count)
    `scalar_sharding` (jit's in_shardings refuses a leaf without one)."""
    by_path = {}
    for path, sharding in jax.tree_util.tree_flatten_with_path(param_sharding)[0]:
        by_path[path] = sharding

    def pick(path, leaf):
        # optax keeps per-parameter state (mu, nu) in trees with the params' structure, so the
        # suffix of the path names the parameter.
        for n in range(len(path)):
            if path[n:] in by_path and by_path[path[n:]] is not None:
                return by_path[path[n:]]
        return scalar_sharding
    return jax.tree_util.tree_map_with_path(pick, opt_abstract)
