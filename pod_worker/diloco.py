"""Streaming DiLoCo on one pod (sync.mode = "diloco"): the outer state and the outer steps.

Each pod takes inner steps on its own shard (PodTrainer's programs, with its own AdamW state, no
DCN traffic). The parameters are cut into F fragments of contiguous layers (`fragment_leaves`);
fragment f meets once every H inner steps, at its own offset: outer sync number n (n = 1, 2, ...)
starts after inner step n * H/F and syncs fragment (n - 1) mod F. A sync:

  1. pseudo-gradient: delta_f = agreed_f - local_f (the fragment's last agreed values minus this
     pod's), on the devices;
  2. the data plane sums every pod's delta_f in pod order, each encoded in sync.outer_dtype and
     decoded alike on every pod (Exchange.all_reduce on the fragment's leaves, keyed by n; on a
     pod of several hosts, host h of every pod sums block h of each leaf and the pod's hosts
     gather the blocks when the step is applied: diloco_hosts.py);
  3. after tau more inner steps (sync.overlap_steps; the exchange runs on a thread meanwhile), the
     outer optimizer (optax SGD, Nesterov or not) steps agreed_f with the mean, and the pod's
     fragment takes the new agreed values.

Every input of steps 2-3 is bitwise the same on every pod (the pod-ordered sum of the same
decoded bytes, the same agreed values, the same outer state), and so is the program: after a
fragment's outer step, its values and the outer state are bitwise identical on every pod. The
inner state (the local parameters between syncs, AdamW's moments) stays on each pod. The
fragment takes the agreed values outright (the Streaming DiLoCo paper's mixing factor 0): mixing
in the pod's own progress would leave the pods different after the outer step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from multipod.pod_worker.diloco_hosts import HostFragments
from multipod.pod_worker.diloco_replicas import OuterReplicas, Replica
from multipod.pod_worker.diloco_warmup import OuterWarmUp
from multipod.pod_worker.hosts import host_value, start_host_copy
from multipod.pod_worker.optimizer import opt_shardings
from multipod.pod_worker.schema import OuterOptimizer, SyncConfig
from multipod.pod_worker.shared_programs import shared

log = logging.getLogger(__name__)

_BLOCK = re.compile(r"block_(\d+)$")


def fragment_leaves(params, num_layers: int, fragments: int) -> list[list[int]]:
    """The leaf indices (in tree order) of each of `fragments` groups of contiguous layers: block i
    goes to fragment i * F // L; the embedding (shared by input and output) joins the first
    fragment, any other top-level parameter (the final norm) the last."""
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        top = path[0].key if hasattr(path[0], "key") else str(path[0])
        block = _BLOCK.match(str(top))
        if block:
            fragment = int(block.group(1)) * fragments // num_layers
        else:
            fragment = 0 if str(top) == "embedding" else fragments - 1
        groups[fragment].append(index)
    return groups


def outer_optimizer(sync: SyncConfig) -> optax.GradientTransformation:
    """The outer step that the averaged pseudo-gradient drives (sync.outer_optimizer)."""
    return _outer_tx(*_outer_settings(sync))


def _outer_settings(sync: SyncConfig) -> tuple:
    """What of `sync` the outer optimizer is made of."""
    return sync.outer_optimizer, sync.outer_lr, sync.outer_momentum


def _outer_tx(kind: OuterOptimizer, lr: float, momentum: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum or None, nesterov=kind is OuterOptimizer.NESTEROV)


@shared
def _fragment_programs(settings: tuple, layouts: tuple, scalar_sharding) -> dict:
    """One fragment's outer programs for the outer optimizer's settings (_outer_settings) and its
    leaves' (shape, dtype, sharding): the same jit objects for equal arguments (shared_programs)."""
    tx = _outer_tx(*settings)
    shardings = [sharding for _, _, sharding in layouts]

    def update(agreed, state, summed, count):
        mean = [s / count for s in summed]
        updates, state = tx.update(mean, state, agreed)
        return optax.apply_updates(agreed, updates), state

    def delta(agreed, local):
        return [a - b for a, b in zip(agreed, local)]

    abstract = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in layouts]
    state_shardings = opt_shardings(jax.eval_shape(tx.init, abstract), shardings, scalar_sharding)
    return {"init": jax.jit(tx.init, out_shardings=state_shardings),
            "delta": jax.jit(delta, out_shardings=shardings),
            "update": jax.jit(update, out_shardings=(shardings, state_shardings)),
            "copy": jax.jit(lambda values: [jnp.copy(v) for v in values], out_shardings=shardings)}


def outer_restore_template(sync: SyncConfig, params, shardings, scalar_sharding, num_layers: int,
                           meta: dict | None) -> dict:
    """OuterSync.restore_target without an OuterSync: the shapes and layouts of a checkpoint's
    outer state (`meta`: its metadata's "outer") over `params` (arrays or ShapeDtypeStructs) laid
    out by `shardings`, for a reader that wants only the agreed parameters (a prompt-tuning base)."""
    leaves, layouts = jax.tree.leaves(params), jax.tree.leaves(shardings)
    agreed = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=layout) for leaf, layout in zip(leaves, layouts)]
    tx, states = outer_optimizer(sync), []
    fragments = fragment_leaves(params, num_layers, sync.fragments)
    for indices in fragments:
        state = jax.eval_shape(tx.init, [agreed[i] for i in indices])
        placed = opt_shardings(state, [layouts[i] for i in indices], scalar_sharding)
        states.append(jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, placed))
    target: dict = {"agreed": agreed, "states": jax.tree.leaves(states)}
    pending = (meta or {}).get("pending")
    if pending:
        target["pending"] = [np.zeros(leaves[i].shape, leaves[i].dtype) for i in fragments[int(pending["fragment"])]]
    return target


@dataclasses.dataclass
class OuterReport:
    """One outer step this pod applied (reported in the StepReply of the inner step that applied it)."""
    sync: int                 # the outer sync's number (1, 2, ...)
    fragment: int
    started_at: int           # the inner step count the pseudo-gradient was taken at
    bytes_sent: int
    bytes_received: int
    seconds: float            # from the start of the exchange until the outer step was applied
    exposed_s: float          # of which the inner steps waited (all of it without overlap)
    pods: tuple[int, ...] = (0,)  # the pods whose pseudo-gradients it averaged


@dataclasses.dataclass
class _Pending:
    sync: int
    fragment: int
    started_at: int
    apply_at: int
    started: float                                  # perf_counter
    result: concurrent.futures.Future               # -> (summed leaves of the fragment, stats, pods)
    full: list | None = None                        # the pseudo-gradient, by leaf index (None: restored)
    link: object = None                             # the all_reduce it was exchanged on
    extra: dict = dataclasses.field(default_factory=dict)   # hosted replicas' pseudo-gradients, by slot
    whole: bool = True      # result holds whole leaves; False: this host's blocks, to gather (several hosts)


class OuterSync(OuterReplicas, OuterWarmUp):
    """The agreed parameters and the outer optimizer's state of one pod, and its outer steps.

    `params` and `shardings`: the trainer's (the agreed copy starts equal to the pods' identical
    initial parameters); `scalar_sharding`: where a scalar of the outer state lives; `assembler`:
    a pod of several hosts' (hosts.Assembler): each host exchanges its blocks (diloco_hosts.py)."""

    def __init__(self, sync: SyncConfig, params, shardings, scalar_sharding, num_layers: int, num_pods: int,
                 assembler=None):
        self.sync, self.num_pods = sync, num_pods
        self._scalar_sharding = scalar_sharding
        self.fragments = fragment_leaves(params, num_layers, sync.fragments)
        self._treedef = jax.tree.structure(params)
        self._shardings = jax.tree.leaves(shardings)
        self.agreed: list[jax.Array] = [jnp.copy(leaf) for leaf in jax.tree.leaves(params)]
        self._programs = [self._compile(leaves) for leaves in self.fragments]
        self.states = self._initial_states()
        self.pending: _Pending | None = None
        self.version = 0        # outer steps applied by this object (the agreed state changes only then)
        self.applied = 0        # the number of the last outer sync applied
        self.replicas: dict[int, Replica] = {}
        # (sync, apply count, fragment, its agreed values after it) of the outer steps since
        # history_from inner steps: what a replica rebuilt from a checkpoint part merges. A replay
        # starts from a checkpoint, so nothing is kept before this pod's first save (history_from
        # None): a run without checkpoints would otherwise hold a copy of the model every H steps.
        self.history: list[tuple[int, int, int, list[np.ndarray]]] = []
        self.history_from: int | None = None
        self.history_bytes, self.history_budget_bytes = 0, sync.replay_history_mb << 20
        self.history_too_big_warned = False
        self.hosts = None if assembler is None else HostFragments(assembler, self.fragments,
                                                                  [leaf.dtype for leaf in self.agreed])
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-sync")

    def _initial_states(self) -> list:
        """The outer optimizer's initial state of each fragment, for the current agreed values."""
        return [program["init"]([self.agreed[i] for i in leaves])
                for program, leaves in zip(self._programs, self.fragments)]

    def _compile(self, leaves: list[int]) -> dict:
        layouts = tuple((tuple(self.agreed[i].shape), jnp.dtype(self.agreed[i].dtype), self._shardings[i])
                        for i in leaves)
        return _fragment_programs(_outer_settings(self.sync), layouts, self._scalar_sharding)

    # -- the schedule ----------------------------------------------------------------------------
    def sync_at(self, count: int) -> int | None:
        """The number of the outer sync that starts once `count` inner steps are done, or None."""
        period = self.sync.period
        return count // period if count > 0 and count % period == 0 else None

    def fragment_of(self, sync: int) -> int:
        return (sync - 1) % self.sync.fragments

    def next_sync(self, count: int) -> int:
        """The number of the first outer sync not yet started after `count` inner steps (the key the
        data plane expects next)."""
        if self.pending is not None:
            return self.pending.sync
        return count // self.sync.period + 1

    def waits_at(self, count: int) -> bool:
        """Whether inner step `count` ends waiting for an outer exchange (its result is applied
        then): the step that applies a pending sync, or without overlap the step that starts one."""
        if self.pending is not None:
            return count >= self.pending.apply_at
        return self.sync_at(count) is not None and self.sync.overlap_steps == 0

    # -- the outer steps -------------------------------------------------------------------------
    def after_step(self, count: int, params, all_reduce: Callable | None) -> tuple[object, OuterReport | None]:
        """After inner step `count` (counted from 1): apply the outer step due now, start the sync
        due now; returns (the parameters, changed where an outer step applied, and its report).
        `all_reduce(sync, leaves, order) -> (summed, stats, pods)`: the pod-order sum of the
        given leaves over the pods taking part (`pods`, their indices) (None for one pod, whose pseudo-gradient is
        its own); a pending sync whose exchange failed is exchanged again on a newer all_reduce
        (after a change of membership). An exchange that fails raises here, the outer state as
        it was (a sync that started in this call is forgotten: the step's retry starts it again)."""
        report = None
        leaves = jax.tree.leaves(params)
        if self.pending is not None and count >= self.pending.apply_at:
            leaves, report = self._apply(leaves, all_reduce)
        sync = self.sync_at(count)
        if sync is not None:
            if self.pending is not None:    # the schedule forbids it (overlap_steps < H / F)
                raise RuntimeError(f"outer sync {sync} starts while sync {self.pending.sync} is still pending")
            self._start(sync, count, leaves, all_reduce)
            if self.sync.overlap_steps == 0:
                try:
                    leaves, report = self._apply(leaves, all_reduce)
                except BaseException:
                    self.pending = None
                    raise
        return jax.tree.unflatten(self._treedef, leaves), report

    def _start(self, sync: int, count: int, leaves: list, all_reduce: Callable | None) -> None:
        fragment = self.fragment_of(sync)
        indices = self.fragments[fragment]
        delta = self._programs[fragment]["delta"]([self.agreed[i] for i in indices], [leaves[i] for i in indices])
        for value in delta:
            start_host_copy(value)
        full = self._full(delta, indices, len(leaves))
        extra = {slot: self.replica_delta(replica, sync) for slot, replica in sorted(self.replicas.items())}
        self.pending = _Pending(sync, fragment, count, count + self.sync.overlap_steps, time.perf_counter(),
                                self._submit(all_reduce, sync, full, indices, extra), full, all_reduce, extra,
                                self._whole(all_reduce))

    def _whole(self, all_reduce: Callable | None) -> bool:
        """Whether an exchange on `all_reduce` gives whole leaves (or this host's blocks, to gather)."""
        return self.hosts is None or all_reduce is None

    @staticmethod
    def _full(values: list, indices: list[int], size: int) -> list:
        full = [None] * size
        for i, value in zip(indices, values):
            full[i] = value
        return full

    def replica_delta(self, replica: Replica, sync: int) -> list:
        """A replica's pseudo-gradient of outer sync `sync` (its fragment's agreed values minus the
        replica's own), as a full leaf list."""
        indices = self.fragments[self.fragment_of(sync)]
        mine = jax.tree.leaves(replica.params)
        delta = self._programs[self.fragment_of(sync)]["delta"]([self.agreed[i] for i in indices],
                                                               [mine[i] for i in indices])
        return self._full(delta, indices, len(mine))

    def _submit(self, all_reduce: Callable | None, sync: int, full: list, indices: list[int], extra: dict
                ) -> concurrent.futures.Future:
        if all_reduce is None:
            return _done(([full[i] for i in indices], None, (0,)))
        if self.hosts is not None:
            full, extra = self.hosts.blocks(full), {slot: self.hosts.blocks(d) for slot, d in extra.items()}
        return self._thread.submit(self._exchange, all_reduce, sync, full, indices, extra)

    @staticmethod
    def _exchange(all_reduce: Callable, sync: int, full: list, indices: list[int], extra: dict):
        summed, stats, pods = all_reduce(sync, full, indices, extra)
        return [summed[i] for i in indices], stats, pods

    def _apply(self, leaves: list, all_reduce: Callable | None) -> tuple[list, OuterReport]:
        pending = self.pending
        if pending is None:
            raise RuntimeError("no outer sync is pending")
        self._exchange_again_if_moved(pending, all_reduce)
        wait_start = time.perf_counter()
        summed, stats, pods = self._result(pending, None)    # the exchange has its own deadline (dcn.timeout_s)
        exposed = time.perf_counter() - wait_start
        indices = self.fragments[pending.fragment]
        program = self._programs[pending.fragment]
        if pending.whole:
            summed = [jax.device_put(value, self._shardings[i]) for value, i in zip(summed, indices)]
        elif self.hosts is not None:    # raises on every host if one host's exchange failed: pending stays
            summed = self.hosts.gather(pending.fragment, summed)
        self.pending = None
        agreed, self.states[pending.fragment] = program["update"]([self.agreed[i] for i in indices],
                                                                  self.states[pending.fragment], summed,
                                                                  np.float32(len(pods)))
        local = program["copy"](agreed)    # the inner update donates the pod's parameters: never alias them
        leaves = list(leaves)
        for i, value, mine in zip(indices, agreed, local):
            self.agreed[i] = value
            leaves[i] = mine
        for replica in self.replicas.values():
            self._merge(replica, pending.fragment, program["copy"](agreed))
            replica.deltas.pop(pending.sync, None)
        self._remember(pending.sync, pending.apply_at, pending.fragment, agreed)
        self.applied = pending.sync
        self.version += 1
        seconds = time.perf_counter() - pending.started
        exposed = seconds if self.sync.overlap_steps == 0 else exposed
        report = OuterReport(pending.sync, pending.fragment, pending.started_at,
                             getattr(stats, "bytes_sent", 0), getattr(stats, "bytes_received", 0), seconds, exposed,
                             tuple(pods))
        log.debug("outer sync %d (fragment %d) applied: %.3f s, %.3f s exposed, pods %s", pending.sync,
                  pending.fragment, seconds, exposed, pods)
        return leaves, report

    def _exchange_again_if_moved(self, pending: _Pending, all_reduce: Callable | None) -> None:
        """If the membership changed since `pending`'s exchange started (it ran on another link than
        `all_reduce`), start it again on `all_reduce`."""
        if _same_link(pending.link, all_reduce) or pending.full is None:
            return
        # Every pod that started it on the old link exchanges it again on the new one, whatever the
        # old exchange did there. It may have ended well on one pod (its peer's bytes had arrived)
        # and failed on another; keeping that result would leave the other waiting alone on the
        # new link. The aborted old exchange ends first (its own deadline, dcn.timeout_s, bounds it).
        concurrent.futures.wait([pending.result])
        pending.result = self._submit(all_reduce, pending.sync, pending.full, self.fragments[pending.fragment],
                                      pending.extra)
        pending.link, pending.whole = all_reduce, self._whole(all_reduce)

    # -- the agreed state ------------------------------------------------------------------------
    def agreed_params(self):
        """The agreed parameters (every fragment as of its last outer step), as a tree."""
        return jax.tree.unflatten(self._treedef, self.agreed)

    def agreed_state(self) -> tuple:
        """What every pod holds bitwise alike: the agreed parameters and the outer optimizer states."""
        return self.agreed_params(), self.states

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, timeout_s: float, all_reduce: Callable | None = None) -> tuple[dict, dict]:
        """(arrays, metadata) of the outer state for a checkpoint, between steps: the agreed
        parameters, the outer optimizer states' leaves, and a sync still pending (its exchange
        waited for, within timeout_s: its pod-order sum is saved, so a resumed run applies the
        very same outer step without exchanging again). `all_reduce`: the pod's current link; a
        pending sync whose exchange ran on an older one (the membership changed since, a pod
        died) is exchanged again on it first, as the step that applies it would."""
        arrays = {"agreed": list(self.agreed), "states": jax.tree.leaves(self.states)}
        meta: dict = {"pending": None}
        pending = self.pending
        if pending is not None:
            if all_reduce is not None:
                self._exchange_again_if_moved(pending, all_reduce)
            summed, stats, pods = self._result(pending, timeout_s)
            if not pending.whole and self.hosts is not None:   # whole leaves, gathered now (every host saves)
                summed, pending.whole = [host_value(v) for v in self.hosts.gather(pending.fragment, summed)], True
            pending.result = _done((summed, stats, pods))
            arrays["pending"] = [np.asarray(value) for value in summed]
            meta["pending"] = {"sync": pending.sync, "fragment": pending.fragment,
                               "started_at": pending.started_at, "apply_at": pending.apply_at,
                               "pods": list(pods)}
        return arrays, meta

    def restore_target(self, meta: dict) -> dict:
        """The restore target of checkpoint(): arrays shaped and laid out as this pod's."""
        target = {"agreed": list(self.agreed), "states": jax.tree.leaves(self.states)}
        pending = (meta or {}).get("pending")
        if pending:
            target["pending"] = [np.zeros(self.agreed[i].shape, self.agreed[i].dtype)
                                 for i in self.fragments[int(pending["fragment"])]]
        return target

    def load(self, arrays: dict, meta: dict, count: int) -> None:
        """Replace the outer state with a checkpoint's (restore_target's shape), taken after
        `count` inner steps; the replicas and the history start afresh."""
        self.agreed = [jax.device_put(value, sharding) for value, sharding in zip(arrays["agreed"], self._shardings)]
        self.states = jax.tree.unflatten(jax.tree.structure(self.states), [  # laid out as the pod's (several hosts)
            jax.device_put(new, old.sharding) for new, old in zip(arrays["states"], jax.tree.leaves(self.states))])
        self.pending = None
        pending = (meta or {}).get("pending")
        if pending:
            summed = [np.asarray(value) for value in arrays["pending"]]
            self.pending = _Pending(int(pending["sync"]), int(pending["fragment"]), int(pending["started_at"]),
                                    int(pending["apply_at"]), time.perf_counter(),
                                    _done((summed, None, tuple(pending["pods"]))))
        self.applied = self.pending.sync - 1 if self.pending is not None else count // self.sync.period
        self.replicas, self.history, self.history_from, self.history_bytes = {}, [], count, 0
        self.version += 1

    def start_from(self, params, count: int) -> None:
        """Start the outer state afresh from `params`, taken after `count` inner steps: the agreed
        values become a copy of them and the outer optimizer's state its initial one, as at the
        start of a run (a warm start from an every-step checkpoint, which every pod restores alike).
        The outer syncs go on from `count` on the same cycle as a run that began there."""
        self.agreed = [jnp.copy(leaf) for leaf in jax.tree.leaves(params)]
        self.states = self._initial_states()
        self.pending = None
        self.applied = count // self.sync.period
        self.replicas, self.history, self.history_from, self.history_bytes = {}, [], count, 0
        self.version += 1

    def _result(self, pending: _Pending, timeout_s: float | None) -> tuple:
        """The pending sync's exchange result; if it failed, this host still takes part in the
        gather of a pod of several hosts (the others wait for it there) before raising."""
        try:
            return pending.result.result(timeout=timeout_s)
        except BaseException:
            if not pending.whole and self.hosts is not None:
                self.hosts.take_part(pending.fragment)
            raise

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _same_link(a, b) -> bool:
    """Whether two all_reduce callables exchange on the same data-plane link (their `key`)."""
    return getattr(a, "key", a) is getattr(b, "key", b)


def _done(value) -> concurrent.futures.Future:
    """A future that already holds `value`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future
