"""One pod's training state and compiled steps, over the pod's own device mesh.

The step is split in two compiled programs so the DCN exchange can sit between them:
  grad_step: forward/backward of the pod's shard -> gradient (scaled by the *global* token count,
             so the pods' gradients sum to the global-batch mean gradient);
  apply_update: summed gradient -> clip (global norm of the summed gradient) -> AdamW, skipped as a
             whole if the summed gradient is not finite. Every pod runs the same program on the
             same bytes, so the decision and the result are identical everywhere.

PodTrainer keeps the mesh and the per-step core (gradients -> exchange -> update -> checksum);
its other jobs are mixins of their own: trainer_programs.py TrainerPrograms (compiling the
programs, choosing the fused or overlapped step, their XLA accounting), trainer_state.py
TrainerState (the state's construction, or only its layout until a restore; checksum,
fingerprint, host copies and loads of the state) and diloco_trainer.py DilocoTrainer (the DiLoCo
outer sync, snapshots, replay).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from multipod.model.partitioning import activate_rules, batch_sharding, make_mesh, replicated
from multipod.pod_worker import split
from multipod.pod_worker.dcn import BLOCK, ExchangeError, ExchangeStats, LeafSpec
from multipod.pod_worker.diloco import OuterSync
from multipod.pod_worker.diloco_trainer import DilocoTrainer
from multipod.pod_worker.generation import Generator
from multipod.pod_worker.hosts import Assembler, HostBlock, HostLayout, check_multi_host, host_value
from multipod.pod_worker.optimizer import make_optimizer, make_schedule
from multipod.pod_worker.outcome import StepOutcome, StepResult
from multipod.pod_worker.schema import Compression, WorkerConfig
from multipod.pod_worker.split import Piece, Relay
from multipod.pod_worker.trainer_programs import TrainerPrograms
from multipod.pod_worker.trainer_state import NoState, TrainerState, fingerprint

# NoState and fingerprint live in trainer_state.py; importers take them from here.
__all__ = ["NoState", "PodTrainer", "fingerprint"]


class PodTrainer(DilocoTrainer, TrainerPrograms, TrainerState):
    """Parameters, optimizer state and compiled programs of one pod. With several hosts
    (`layout`), every host of the pod builds the same trainer over all the pod's devices
    (jax.devices() spans the pod's jax.distributed cluster) and runs the same programs."""

    base_fingerprint = ""   # the frozen base model's, when the pod tunes a prompt (PromptTrainer)

    def __init__(self, config: WorkerConfig, devices=None, layout: HostLayout | None = None,
                 initial_state: bool = True):
        """initial_state=False: no parameters and no optimizer state until load_state (a restore)
        gives them: nothing is initialised that a restore would replace (the init program is not
        compiled or run, and the state is never held twice). Until then the state's uses raise
        NoState."""
        if not initial_state and not self.defers_initial_state:
            raise ValueError(f"{type(self).__name__} always builds its initial state")
        self.config = config
        self.layout = layout = layout or HostLayout()
        devices = list(devices if devices is not None else jax.devices())
        self.mesh_shape = config.mesh.resolve(len(devices))
        self.mesh = make_mesh(*self.mesh_shape, devices=devices)
        self.num_devices = len(devices)
        if layout.multi:
            check_multi_host(self.mesh_shape, jax.local_device_count(), layout)
        self.tx = make_optimizer(config.optimizer, config.schedule_steps)
        # One program (jit): run eagerly, the schedule is a dozen small programs, each traced and
        # compiled (or loaded from the cache) in every worker process.
        self.schedule = jax.jit(make_schedule(config.optimizer, config.schedule_steps))
        self.step = 0

        self.batch_sharding = batch_sharding(self.mesh)
        self.scalar_sharding = replicated(self.mesh)
        params_abstract = self._build_state(initial_state)
        self.leaf_specs = [LeafSpec(tuple(l.shape), np.dtype(l.dtype)) for l in jax.tree.leaves(params_abstract)]
        self._treedef = jax.tree.structure(params_abstract)
        # Several hosts: each exchanges one block of every leaf with its peers on the other pods.
        # int8/int4 scale each block of BLOCK values, restarting at every host's block: blocks
        # that start on that grid decode to the values one host's whole leaves do.
        blocked = config.exchange_dcn().compression in (Compression.INT8, Compression.INT4)
        self.assembler = (Assembler(self.mesh, [s.shape for s in self.leaf_specs], jax.tree.leaves(self.param_sharding),
                                    layout, align=BLOCK if blocked else 1) if layout.multi else None)
        self.outer: OuterSync | None = None     # DiLoCo (sync.mode): the agreed state, set by start_outer
        self._compile()


    @property
    def exchange_specs(self) -> list[LeafSpec]:
        """What this host sends over the DCN per step: every gradient leaf, or with several hosts
        per pod this host's block of every leaf (flat)."""
        assembler = self.assembler
        if assembler is None:
            return self.leaf_specs
        return [LeafSpec((b - a,), spec.dtype) for spec, (a, b) in
                zip(self.leaf_specs, (assembler.block(i) for i in range(len(self.leaf_specs))))]

    def _blocks(self, leaves: list) -> list[HostBlock]:
        """This host's block of every gradient leaf (flat), each read from the device only when
        the exchange takes it."""
        assembler = self.assembler
        if assembler is None:
            raise RuntimeError("a pod of one host exchanges whole leaves, not blocks")
        return [HostBlock(leaf, *assembler.block(index)) for index, leaf in enumerate(leaves)]

    # -- the step ------------------------------------------------------------------------------
    def put_batch(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None) -> jax.Array:
        """Host tokens (int32, or uint8/uint16 as they travel) -> int32 on the pod's devices, split
        over the data axis; the widening runs on the devices. Every target counts here: a loss
        mask is for a prompt-tuning pod (PromptTrainer)."""
        if loss_mask is not None:
            raise ValueError("a loss mask is taken only by a pod tuning a prompt (prompt.kind); this pod trains "
                             "the whole model on every target")
        if self.layout.multi:   # this host's rows of the pod's batch
            global_shape = (tokens.shape[0] * self.layout.hosts_per_pod, *tokens.shape[1:])
            on_device = jax.make_array_from_process_local_data(self.batch_sharding, tokens, global_shape)
        else:
            on_device = jax.device_put(tokens, self.batch_sharding)
        return on_device if on_device.dtype == jnp.int32 else self._widen(on_device)

    def _normalizer(self, global_tokens: int) -> jax.Array:
        """The loss normaliser on the devices, put there once per value (not every step)."""
        cached = getattr(self, "_norm_cache", None)
        if cached is None or cached[0] != global_tokens:
            cached = (global_tokens, jax.device_put(np.float32(global_tokens), self.scalar_sharding))
            self._norm_cache = cached
        return cached[1]

    def gradients(self, tokens: jax.Array, global_tokens: int, to_host: bool = True
                  ) -> tuple[list[jax.Array], float, float]:
        """Forward/backward on this pod's shard; returns the gradient leaves (still on the device;
        with to_host, every device->host copy already started, so the exchange can take them one
        by one while later ones are still copying) and the loss sums."""
        leaves, ce, z = self._dispatch_gradients(tokens, self._normalizer(global_tokens), to_host)
        return leaves, float(ce), float(z)

    def _dispatch_gradients(self, tokens: jax.Array, norm: jax.Array, to_host: bool
                            ) -> tuple[list, jax.Array, jax.Array]:
        """gradients, without waiting: (leaves, ce, z) on the devices, being computed."""
        k = self.config.model.microbatches
        grads, ce, z = self._grad(tokens, norm) if k == 1 else self.microbatches(tokens, norm, 0, k)
        leaves = jax.tree.leaves(grads)
        if to_host and self.assembler is None:
            for leaf in leaves:     # start every device->host copy before waiting on any of them
                leaf.copy_to_host_async()
        return leaves, ce, z

    def _grad(self, tokens, norm, m: int | None = None):
        """The gradient program on a shard: the whole of it, or with microbatches its microbatch m."""
        inputs = self._grad_inputs(tokens, norm)
        if m is not None:
            inputs += (self._microbatch_index(m),)
        if getattr(self, "_compiled_shape", None) == tuple(tokens.shape):
            return self._grad_compiled(*inputs)
        with activate_rules(self.mesh):
            return self._grad_step(*inputs)

    def _microbatch_index(self, m: int) -> jax.Array:
        """m on the devices (put there once per value)."""
        cache = self.__dict__.setdefault("_index_cache", {})
        if m not in cache:
            cache[m] = jax.device_put(np.int32(m), self.scalar_sharding)
        return cache[m]

    def microbatch_gradient(self, tokens: jax.Array, norm: jax.Array, m: int):
        """(gradient tree, ce, z) of microbatch m of a shard, by the step's own programs (the fused
        step's or the overlapped one's), all on the devices and dispatched, not waited for."""
        if self._overlapped is not None:
            return self._overlapped.gradient(self.params, self.summer.microbatch(tokens, m), norm)
        return self._grad(tokens, norm, m)

    def microbatches(self, tokens: jax.Array, norm: jax.Array, start: int, stop: int, partial=None):
        """Microbatches [start, stop) of a shard added, in order, to `partial` (the float32 sum of
        its microbatches [0, start), a tree on the devices; None iff start = 0): (the sum of
        [0, stop), ce, z of [start, stop)). The sum is float32 until stop is the last microbatch;
        then it is the shard's gradient in the parameters' dtypes, bitwise what this pod's step
        computes for the whole shard (accumulate.py). Dispatched, not waited for."""
        losses = None
        for m in range(start, stop):
            g, ce, z = self.microbatch_gradient(tokens, norm, m)
            partial = self.summer.fold(partial, g, m)
            losses = self.summer.add_losses(losses, ce, z)
        if losses is None:
            raise ValueError(f"no microbatch in [{start}, {stop})")
        return partial, *losses

    def put_partial(self, leaves: list) -> dict:
        """A partial sum that came from another pod (float32 host leaves, in tree order) onto this
        pod's devices, laid out as the gradient."""
        return jax.device_put(jax.tree.unflatten(self._treedef, [np.asarray(leaf) for leaf in leaves]),
                              self.param_sharding)

    def abstract_batch(self, tokens: jax.ShapeDtypeStruct):
        """What put_batch makes of tokens shaped so, without data (compile_for)."""
        return tokens

    def _grad_inputs(self, batch, norm, params=None) -> tuple:
        """The gradient program's arguments for a batch put_batch made (or its abstract_batch), with
        the trainer's parameters (or `params`, e.g. their layout)."""
        return self.params if params is None else params, batch, norm

    def train_step(self, batch: jax.Array, global_tokens: int, all_reduce=None,
                   take_fingerprint: bool = False, extra: dict[int, jax.Array] | None = None,
                   pieces: list[Piece] | None = None, relay: Relay | None = None) -> StepOutcome:
        """The per-step core: gradients -> exchange -> update -> checksum.

        all_reduce(grads) -> (summed, stats) sums the pods' gradient leaves in pod order (the DCN
        exchange); None for a single pod, whose gradient never leaves the device. The state
        changes only if every part succeeds. The state checksum is taken on the devices; with
        take_fingerprint the fingerprint (BLAKE2b of a host copy of the state) is taken too
        (timed in fingerprint_s).

        extra (degraded mode): {slot: batch} of failed pods' shards this pod computes too, each
        with the very program of its own shard (so each gradient is bitwise the one that pod
        would have computed); they reach all_reduce as extra={slot: leaves}, kept apart, and the
        exchange sums each in its slot.

        pieces (degraded mode, a failed slot's microbatches split over the live pods,
        pod_worker/split.py): this pod's runs of microbatches, computed first (other pods wait
        for them); each continues the partial sum relay.receive brings and passes its own on
        with relay.send, or, ending the slot, reaches all_reduce as that slot's extra leaves (and
        its loss, carried along the chain, is reported as that slot's shard). On a pod of several
        hosts each host relays its block of every partial sum (split.py)."""
        self.require_state("train")
        extra = dict(sorted((extra or {}).items()))
        pieces = sorted(pieces or [], key=lambda piece: piece.slot)
        if (extra or pieces) and all_reduce is None:
            raise ValueError("extra shards need an exchange to sum them in their slots")
        if pieces and relay is None:
            raise ValueError("split shards need a relay for their partial sums")
        if self._overlapped is not None:
            outcome = self._train_step_overlapped(batch, global_tokens, all_reduce, extra, pieces, relay)
        else:
            outcome = self._train_step_fused(batch, global_tokens, all_reduce, extra, pieces, relay)
        if take_fingerprint:
            start = time.perf_counter()
            outcome.fingerprint = self.fingerprint()
            outcome.fingerprint_s = time.perf_counter() - start
        return outcome

    def target_count(self, batch) -> int:
        """The targets the loss counts in a batch put_batch made."""
        return int(batch.shape[0] * (batch.shape[1] - 1))

    def _train_step_fused(self, batch: jax.Array, global_tokens: int, all_reduce, extra: dict,
                          pieces: list[Piece], relay: Relay | None) -> StepOutcome:
        """One compiled gradient program, then the exchange of its leaves, then the update.
        exposed_exchange_s: from the end of the gradient program until every summed leaf is on the
        devices (here the whole exchange, since nothing overlaps it)."""
        t0 = time.perf_counter()
        norm = self._normalizer(global_tokens)
        launched = split.launch_pieces(self, pieces, norm)
        # A single pod's gradient never leaves the device.
        grads, ce_d, z_d = self._dispatch_gradients(batch, norm, to_host=all_reduce is not None)
        assembled, piece_shards, failed = split.relay_pieces(self, launched, relay)
        ce, z = float(ce_d), float(z_d)     # the pod's own gradient program is done
        shards, extra_grads = [(None, ce + z, z, self.target_count(batch))], {}
        for slot, shard in extra.items():
            extra_grads[slot], ce_k, z_k = self.gradients(shard, global_tokens, to_host=True)
            shards.append((slot, ce_k + z_k, z_k, self.target_count(shard)))
        extra_grads = dict(sorted({**extra_grads, **assembled}.items()))
        shards += piece_shards
        t1 = time.perf_counter()
        summed, link = self._exchange(all_reduce, grads, extra_grads, failed=failed)
        t2 = time.perf_counter()
        jax.block_until_ready([leaf for leaf in summed if isinstance(leaf, jax.Array)])
        t_ready = time.perf_counter()
        result = self.apply(summed)
        t3 = time.perf_counter()
        return self._finish(shards, result, t3, link, compute_s=t1 - t0, exchange_s=t2 - t1,
                            update_s=t3 - t2, exposed_exchange_s=t_ready - t1)

    def _train_step_overlapped(self, batch: jax.Array, global_tokens: int, all_reduce, extra: dict,
                               pieces: list[Piece], relay: Relay | None) -> StepOutcome:
        """train_step with dcn.overlap: every per-layer program is dispatched at once, and the
        exchange takes the gradient leaves in readiness order (all_reduce(grads, order=...)),
        blocking on each only when its turn comes while later backward programs keep running.

        compute_s is the backward pass (launch -> last gradient ready); exchange_s the whole
        exchange, which overlaps it; exposed_exchange_s the part after the backward pass, until
        every summed leaf is on the devices."""
        overlapped = self._overlapped
        if overlapped is None:
            raise RuntimeError("the overlapped step was not chosen for this step's shape")
        t0 = time.perf_counter()
        norm = self._normalizer(global_tokens)
        piece_sums = split.launch_pieces(self, pieces, norm)
        launched = overlapped.launch(self.params, batch, norm, to_host=all_reduce is not None)
        # Failed pods' shards: the same per-layer programs, dispatched now, summed in their slots.
        others = {slot: overlapped.launch(self.params, shard, norm) for slot, shard in extra.items()}
        assembled, piece_shards, failed = split.relay_pieces(self, piece_sums, relay)
        t1 = time.perf_counter()
        extra_leaves = dict(sorted({**{slot: o.leaves for slot, o in others.items()}, **assembled}.items()))
        summed, link = self._exchange(all_reduce, launched.leaves, extra_leaves, order=launched.order, failed=failed)
        jax.block_until_ready(summed)
        t2 = time.perf_counter()
        backward_end = max(o.backward_end(timeout=self.config.dcn.timeout_s) for o in (launched, *others.values()))
        shards = [(None, float(launched.ce) + float(launched.z), float(launched.z), self.target_count(batch))]
        shards += [(slot, float(o.ce) + float(o.z), float(o.z), self.target_count(extra[slot]))
                   for slot, o in others.items()]
        shards += piece_shards
        result = self.apply(summed)
        t3 = time.perf_counter()
        return self._finish(shards, result, t3, link, compute_s=backward_end - t0, exchange_s=t2 - t1,
                            update_s=t3 - t2, exposed_exchange_s=max(0.0, t2 - backward_end))

    def _exchange(self, all_reduce, leaves: list, extra: dict, order: list[int] | None = None,
                  failed: Exception | None = None) -> tuple[list, ExchangeStats | None]:
        """The pods' pod-order sum of the gradient leaves (and of the extra slots' leaves, summed
        in their slots), and the exchange's stats; (leaves, None) without an exchange (a single
        pod). `order`: the leaf order the exchange takes (the overlapped step's readiness order).
        `failed`: this host already failed the step (a partial sum it could not send); with
        several hosts it still takes part in the gather, then raises it."""
        if failed is not None and self.assembler is None:
            raise failed
        if all_reduce is None:
            return leaves, None
        kwargs: dict = {} if order is None else {"order": order}
        if self.assembler is None:
            return all_reduce(leaves, extra=extra, **kwargs) if extra else all_reduce(leaves, **kwargs)
        # Several hosts: this host exchanges its block of every leaf with the same host of the
        # other pods; the summed blocks are gathered over the pod's hosts on its devices.
        blocks = self._blocks(leaves)
        extra_blocks = {slot: self._blocks(g) for slot, g in extra.items()}
        failure, summed_blocks, link = failed, None, None
        try:
            if failure is None:
                summed_blocks, link = (all_reduce(blocks, extra=extra_blocks, **kwargs) if extra_blocks
                                       else all_reduce(blocks, **kwargs))
                summed_blocks = [np.asarray(b) for b in summed_blocks]
        except Exception as exc:   # noqa: BLE001 - re-raised below, after the pod's hosts agree
            failure = exc
        # Every host takes part in the gather, failed or not, so that none waits in it alone.
        summed, every_host = self.assembler(summed_blocks, [s.dtype for s in self.leaf_specs])
        if failure is not None:
            raise failure
        if not every_host or summed is None:
            raise ExchangeError("another host of this pod failed its part of the exchange; the step is "
                                "undone on every host")
        return summed, link

    def _finish(self, shards: list, result: StepResult, updated_at: float, link: ExchangeStats | None, *,
                compute_s: float, exchange_s: float, update_s: float, exposed_exchange_s: float) -> StepOutcome:
        """The step's checksum (timed from `updated_at`, when the update returned) and its
        outcome; `shards`: (slot, loss_sum, z_loss_sum, tokens) of every shard computed, own first."""
        checksum = self.checksum()
        checksum_s = time.perf_counter() - updated_at
        return StepOutcome(loss_sum=sum(s[1] for s in shards), z_loss_sum=sum(s[2] for s in shards),
                           tokens=sum(s[3] for s in shards), grad_norm=result.grad_norm,
                           learning_rate=result.learning_rate, skipped=result.skipped, checksum=checksum,
                           checksum_s=checksum_s, link=link, shards=shards, compute_s=compute_s,
                           exchange_s=exchange_s, update_s=update_s, exposed_exchange_s=exposed_exchange_s)

    def summed_leaf_hook(self):
        """What the exchange calls on each leaf as soon as it is summed (None: nothing). The
        overlapped step puts it on the devices at once, hidden under the backward pass still
        running. The fused step has nothing left to hide it under: its leaves stay on the host for
        apply's one batched put, which costs about a third of a put per leaf (docs/benchmarks.md,
        "The exchange's rate in a real run"). With several hosts per pod the trainer sums blocks
        and gathers them itself."""
        if self.assembler is not None or self._overlapped is None:
            return None
        return self.put_leaf

    def put_leaf(self, index: int, value: np.ndarray) -> jax.Array:
        """Start the host->device transfer of one summed gradient leaf (asynchronous)."""
        if not hasattr(self, "_leaf_shardings"):
            self._leaf_shardings = jax.tree.leaves(self.param_sharding)
        return jax.device_put(value, self._leaf_shardings[index])

    def apply(self, summed: list) -> StepResult:
        """Apply the all-pod gradient sum (host arrays, or device arrays from put_leaf or from
        gradients). The state only changes when the whole step succeeds."""
        grads = jax.device_put(jax.tree.unflatten(self._treedef, summed), self.param_sharding)
        count = self._count if getattr(self, "_count", None) is not None else self.opt_count()
        update = getattr(self, "_update_compiled", None) or self._apply_update
        params, opt_state, norm, finite = update(self.params, self.opt_state, grads)
        # The learning rate is reported from a count kept on the host (no copy of the state's
        # scalars), computed while the update runs.
        lr = self._learning_rate(count)
        self.params, self.opt_state = params, opt_state
        self.step += 1
        applied = bool(finite)
        self._count = count + int(applied)   # a skipped update leaves the optimizer's count as it was
        return StepResult(float(norm), not applied, lr)

    def _learning_rate(self, count: int) -> float:
        """The schedule's value after `count` updates (memoised: one evaluation per count)."""
        cache = self.__dict__.setdefault("_lr_cache", {})
        if count not in cache:
            if len(cache) > 4096:
                cache.clear()
            cache[count] = float(self.schedule(count))
        return cache[count]

    def opt_count(self) -> int:
        """Number of updates the optimizer has applied (drives the learning-rate schedule)."""
        counts = [host_value(l) for l in jax.tree.leaves(self.opt_state) if np.ndim(l) == 0]
        return int(counts[-1]) if counts else self.step

    def evaluate(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None) -> tuple[float, int]:
        """Loss sum and target tokens of a whole batch (with several hosts, every host is given
        the whole batch and puts its own rows on its devices)."""
        if loss_mask is not None:
            raise ValueError("a loss mask is taken only by a pod tuning a prompt (prompt.kind)")
        self.require_state("evaluate")
        batch: jax.Array
        if self.layout.multi:
            batch = jax.make_array_from_callback(tokens.shape, self.batch_sharding, lambda index: tokens[index])
            batch = batch if batch.dtype == jnp.int32 else self._widen(batch)
        else:
            batch = self.put_batch(tokens)
        with activate_rules(self.mesh):
            ce, z = self._eval_step(self.agreed_params, batch)
        return float(ce), int(tokens.shape[0] * (tokens.shape[1] - 1))

    @functools.cached_property
    def generator(self) -> Generator:
        """Generation on this trainer's mesh with its parameter layout (pod_worker/generation.py),
        built on first use; it goes with the trainer, so a reconfigured pod keeps no old programs."""
        return Generator(self.config.model, self.mesh, self.param_sharding)
