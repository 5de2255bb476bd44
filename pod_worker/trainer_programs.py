"""A PodTrainer's compiled programs, a mixin of PodTrainer (trainer.py): built from programs.py's
pure functions over the pod's shardings, the step chosen (fused, or overlapped per layer:
pod_worker/overlap.py, dcn.overlap) and compiled ahead of time for a shard shape, the programs a
run calls later warmed up at configure, and XLA's memory and FLOPs accounting of the step."""
from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from multipod.model.partitioning import activate_rules
from multipod.pod_worker import overlap, programs
from multipod.pod_worker.accumulate import MicrobatchSum
from multipod.pod_worker.schema import resolve_overlap

log = logging.getLogger(__name__)


def _widen(tokens: jax.Array) -> jax.Array:
    """Narrow token batches (uint8/uint16 on the wire) as int32 (one function for every trainer:
    jax's caches are keyed on it)."""
    return tokens.astype(jnp.int32)


class TrainerPrograms:
    """The compiled programs of PodTrainer: it works on PodTrainer's config, mesh, shardings and
    state."""

    def _compile(self) -> None:
        # With microbatches, one program computes one microbatch's gradient, run once per
        # microbatch; the programs of pod_worker/accumulate.py sum them in their fixed order (so a
        # failed pod's microbatches can be computed on several pods and summed to the same bits).
        k = self.config.model.microbatches
        grad_step = programs.make_grad_step(self.config.model) if k == 1 else \
            programs.make_microbatch_grad_step(self.config.model)
        apply_update = programs.make_apply_update(self.tx)
        eval_step = programs.make_eval_step(self.config.model)
        p, o, b, s = self.param_sharding, self.opt_sharding, self.batch_sharding, self.scalar_sharding
        with activate_rules(self.mesh):
            self._grad_step = jax.jit(grad_step, in_shardings=(p, b, s) + ((s,) if k > 1 else ()),
                                      out_shardings=(p, s, s))
            self._apply_update = jax.jit(apply_update, in_shardings=(p, o, p), out_shardings=(p, o, s, s),
                                         donate_argnums=(0, 1))
            self._eval_step = jax.jit(eval_step, in_shardings=(p, b), out_shardings=(s, s))
            # The per-step state checksum, computed where the state lives (no host copy).
            self._checksum = programs.checksum_program(p, o, out_sharding=s)
            # Narrow token batches (uint8/uint16 on the wire) become int32 on the devices.
            self._widen = jax.jit(_widen, in_shardings=b, out_shardings=b)
        self.summer = MicrobatchSum(self.config.model, self.mesh)
        self._overlapped: overlap.OverlappedGradStep | None = None
        self._choose_step(self.config.train.global_batch)

    def _choose_step(self, rows: int) -> bool:
        """Run the overlapped step (dcn.overlap: per-layer programs, pod_worker/overlap.py, so each
        block's gradient can leave the pod while earlier blocks' backward programs still run) or the
        fused one, for a pod's step of `rows` sequences (schema.resolve_overlap); whether it overlaps."""
        overlapped, self._fused_because = resolve_overlap(self.config, rows)
        if not overlapped:
            self._overlapped = None
        elif self._overlapped is None:     # jit wrappers only: each program compiles at its first call
            self._overlapped = overlap.OverlappedGradStep(self.config.model, self.mesh, self.param_sharding,
                                                          self.summer)
        return overlapped

    @property
    def step_compiled(self) -> bool:
        """Whether compile_for compiled the step's programs (a pod configured to generate only
        did not)."""
        return hasattr(self, "_grad_compiled")

    @property
    def overlapped(self) -> bool:
        """Whether the pod's step is now the overlapped one (the last _choose_step's decision)."""
        return self._overlapped is not None

    def compile_for(self, batch_shape: tuple[int, int]) -> dict:
        """Choose the step (fused or overlapped) and compile its programs ahead of time for a shard
        shape; return compile timings. The fused gradient program is compiled either way: its
        XLA analyses are the step's memory and FLOPs accounting (compiled_stats)."""
        overlapped = self._choose_step(batch_shape[0])
        log.info("the gradient step: %s", "overlapped (per-layer programs)" if overlapped
                 else f"fused ({self._fused_because})")
        start = time.perf_counter()
        batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=self.batch_sharding)
        norm = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.scalar_sharding)
        # Lowered for the state's layout, not the state itself: a pod that awaits its state has none.
        params, opt_state = self.state_abstract["params"], self.state_abstract["opt_state"]
        inputs = self._grad_inputs(self.abstract_batch(batch), norm, params)
        if self.config.model.microbatches > 1:
            inputs += (jax.ShapeDtypeStruct((), jnp.int32, sharding=self.scalar_sharding),)
        with activate_rules(self.mesh):
            self._grad_compiled = self._grad_step.lower(*inputs).compile()
            self._update_compiled = self._apply_update.lower(params, opt_state, params).compile()
            self._checksum_compiled = self._checksum.lower(params, opt_state).compile()
        self._compiled_shape = tuple(batch_shape)
        return {"compile_s": time.perf_counter() - start}

    def warm_up(self, batch_shape: tuple[int, int], evaluate: bool = True) -> None:
        """Run, once, the programs a run calls later that compile_for does not compile ahead: the
        evaluation of a shard (if the run evaluates: `evaluate`), the learning-rate schedule and,
        with the overlapped step, its per-layer programs, on a pod's shard of zeros. They then
        compile (or load from the persistent compilation cache) at configure, where pods that
        share a cache compile them once (Cluster.configure), instead of at the first step and
        evaluation, where every pod would compile them at once. The state is untouched: nothing
        is applied. A trainer that awaits its state compiles the evaluation for the state's layout
        (its first evaluation then traces it again, and loads it from the cache) and leaves the
        per-layer programs to its first step."""
        if not self.has_state:
            if evaluate:
                batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=self.batch_sharding)
                with activate_rules(self.mesh):
                    self._eval_step.lower(self.state_abstract["params"], batch).compile()
            float(self.schedule(0))
            return
        if evaluate:
            self.evaluate(np.zeros(batch_shape, np.int32))
        # The learning rate a step reports: the schedule's program, compiled at its first call
        # (not memoised here: _learning_rate's cache stays empty).
        float(self.schedule(0))
        if self._overlapped is None:
            return
        rows = batch_shape[0] // self.layout.hosts_per_pod     # this host's rows (put_batch)
        batch = self.put_batch(np.zeros((rows, batch_shape[1]), np.int32))
        norm = jax.device_put(np.float32(1.0), self.scalar_sharding)
        jax.block_until_ready(self._overlapped.launch(self.params, batch, norm, to_host=False).leaves)

    def compiled_stats(self) -> dict:
        """Memory and hardware FLOPs of the programs `compile_for` compiled, from XLA.

        Memory is per device: the gradient program's arguments/outputs/temporaries (the step's
        peak, where activations live; with microbatches, one microbatch's program plus the
        float32 sum it adds into) and the update program's peak. hardware_flops_per_step is the
        whole pod's (per-device FLOPs x devices) for one step: gradient program (once per
        microbatch), recompute included, plus the update.
        """
        if not self.step_compiled:
            raise RuntimeError("compiled_stats() needs compile_for() first")
        grad_mem = programs.memory_stats(self._grad_compiled)
        k = self.config.model.microbatches
        if k > 1 and grad_mem["peak_bytes"] is not None:
            grad_mem["peak_bytes"] += sum(4 * int(np.prod(sharding.shard_shape(leaf.shape)))
                                          for leaf, sharding in zip(jax.tree.leaves(self.params),
                                                                    jax.tree.leaves(self.param_sharding)))
        update_mem = programs.memory_stats(self._update_compiled)
        grad_flops = programs.program_flops(self._grad_compiled, k)
        update_flops = programs.program_flops(self._update_compiled)
        hw = None if grad_flops is None else (grad_flops + (update_flops or 0.0)) * self.num_devices
        return {**grad_mem, "update_peak_bytes": update_mem["peak_bytes"], "hardware_flops_per_step": hw}
