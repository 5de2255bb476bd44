"""Microbatch gradients summed in one fixed order, by programs of their own, so that a slot's
gradient can be assembled from microbatches computed on several pods to the very bits the slot's
own pod computes (degraded mode spreads a failed pod's microbatches over every survivor).

With model.microbatches = M > 1, a shard's gradient is, per leaf and in float32,

    acc = g_0;  acc = acc + g_1;  ...;  gradient = (acc + g_{M-1}) cast to the parameter's dtype

where g_m is microbatch m's gradient (programs.split_microbatches: rows m, m+M, ...). Why this
form, and why on the devices:

  * Each g_m is the output of one program (the fused step's unsplit gradient program on the
    microbatch, or dcn.overlap's per-layer programs) that does not know which microbatch, shard
    or pod it serves; every pod compiles the same program for the same mesh shape, so g_m has the
    same bits wherever it is computed. A scan that adds inside the backward program (the fused
    step's former form) does not give that: XLA may fuse the add into the backward (a dot's
    output fusion), so a sum made elsewhere from separately computed g_m could differ.
  * The adds are programs of their own (inputs materialised, nothing to fuse with but the cast),
    elementwise float32 additions, which IEEE rounds alike in any program. They run on the
    devices for the healthy step and the assembled one alike: numpy on the host would not flush
    denormals as XLA CPU does, so a host assembly would have to be the healthy step's too (and
    cost it a host round trip per microbatch).
  * The sum starts from g_0, not from zeros: 0.0 + (-0.0) = +0.0, so a sum from zeros changes the
    sign bit of a -0.0 in g_0.
  * A partial sum (the f32 acc after microbatch m) can leave the pod as raw bytes and come back
    onto another pod's devices unchanged, so a chain of pods, each adding its microbatches in
    order to its predecessor's partial sum, ends with the healthy bits.

The loss sums are added in the same order (they are reported, not part of the state).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from multipod.model import ModelConfig
from multipod.model.partitioning import activate_rules, batch_sharding, rules_for
from multipod.pod_worker.programs import split_microbatches
from multipod.pod_worker.shared_programs import shared


def _as_f32(g):
    return jax.tree.map(lambda x: x.astype(jnp.float32), g)


def _add(acc, g):
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g)


def _add_last(acc, g):
    return jax.tree.map(lambda a, x: (a + x.astype(a.dtype)).astype(x.dtype), acc, g)


# The adds know nothing of the config or the mesh: one jit each for every MicrobatchSum.
_FIRST, _ADD, _ADD_LAST = jax.jit(_as_f32), jax.jit(_add, donate_argnums=0), jax.jit(_add_last, donate_argnums=0)


@shared
def _microbatch_program(model_cfg: ModelConfig, mesh):
    def microbatch(tokens, m):
        with rules_for(model_cfg):
            return split_microbatches(tokens, model_cfg.microbatches)[m]
    return jax.jit(microbatch, static_argnums=1, out_shardings=batch_sharding(mesh))


class MicrobatchSum:
    """The programs of the fixed-order sum over one pod's mesh: `microbatch` takes microbatch m
    of a shard (its rows stay on their devices); `fold` adds a microbatch's gradient (any tree)
    into the running sum."""

    def __init__(self, model_cfg: ModelConfig, mesh):
        self.count = model_cfg.microbatches
        self._microbatch = _microbatch_program(model_cfg, mesh)
        self._first, self._add, self._add_last = _FIRST, _ADD, _ADD_LAST
        self.mesh = mesh

    def microbatch(self, tokens: jax.Array, m: int) -> jax.Array:
        """Microbatch m of a shard on the devices (asynchronous)."""
        with activate_rules(self.mesh):
            return self._microbatch(tokens, m)

    def fold(self, acc, g, m: int):
        """The sum after microbatch m, from `acc` (the sum after microbatch m-1; None for m = 0)
        and microbatch m's gradient `g` (same tree): float32 until the last microbatch, whose sum
        is cast to g's dtypes. `acc` is donated (its buffers are reused)."""
        if not 0 <= m < self.count:
            raise ValueError(f"microbatch {m} of {self.count}")
        if (acc is None) != (m == 0):
            raise ValueError(f"microbatch {m}: the sum starts at microbatch 0 and only there")
        if m == 0:
            return g if self.count == 1 else self._first(g)
        return (self._add_last if m == self.count - 1 else self._add)(acc, g)

    def add_losses(self, acc, ce, z):
        """The loss sums (ce, z) added to acc (None: the first microbatch's), in float32."""
        return (ce, z) if acc is None else self._add(acc, (ce, z))
