"""DiLoCo's replicas of failed pods (sync.on_pod_failure = "replay"), a mixin of OuterSync
(diloco.py): a survivor hosting a failed pod's slot keeps that pod's own inner state (a Replica),
trains it on the slot's shards and contributes its pseudo-gradients in the slot's place. To
rebuild a replica from the pod's checkpoint part, each pod keeps the agreed values of the outer
steps it applied since its checkpoint before last (the history), which the replay merges where
they were applied."""
from __future__ import annotations

import dataclasses
import logging

import jax

from multipod.pod_worker.hosts import host_value

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Replica:
    """sync.on_pod_failure = "replay": a failed pod's own inner state (its parameters, AdamW state,
    step and update count), rebuilt and then trained on by the survivor hosting its slot, which
    contributes its pseudo-gradients in the slot's place. `deltas`: its pseudo-gradients of outer
    syncs not yet applied, by sync number (full leaf lists)."""
    slot: int
    params: object
    opt_state: object
    step: int
    count: int | None = None
    deltas: dict = dataclasses.field(default_factory=dict)


class OuterReplicas:
    """The replica part of OuterSync: it works on OuterSync's fragments, schedule, history and
    pending sync."""

    replicas: dict[int, Replica]
    history: list[tuple[int, int, int, list]]   # (sync, apply count, fragment, its agreed values after it)
    history_from: int | None                    # the inner step count the history starts after
    history_bytes: int                          # what the history's values take in host memory
    history_budget_bytes: int                   # sync.replay_history_mb
    history_too_big_warned: bool                # one outer step alone was past the budget (warned once)

    def _merge(self, replica: Replica, fragment: int, values: list) -> None:
        """The replica's fragment takes the given agreed values (as the pod's own does)."""
        leaves = jax.tree.leaves(replica.params)
        for i, value in zip(self.fragments[fragment], values):
            leaves[i] = value
        replica.params = jax.tree.unflatten(self._treedef, leaves)

    def _remember(self, sync: int, apply_at: int, fragment: int, agreed: list) -> None:
        """Keep an applied outer step's agreed values in host memory for a later replay (from this
        pod's first save on: history_from). host_value: on a pod of several hosts every host holds
        whole parameters, but not as one addressable array."""
        if self.history_from is None:
            return
        size = sum(int(v.nbytes) for v in agreed)
        if size > self.history_budget_bytes:
            # One outer step alone is past the bound: nothing can be kept, so nothing is copied to
            # the host, and the warning is given once, not at every outer step.
            if not self.history_too_big_warned:
                log.warning("one outer step's values (%d MiB) take more than sync.replay_history_mb = %d MiB: this "
                            "pod keeps no history, and a pod that fails can be replayed only from a checkpoint with "
                            "no outer step applied since (raise sync.replay_history_mb)", size >> 20,
                            self.history_budget_bytes >> 20)
                self.history_too_big_warned = True
            self.history, self.history_bytes, self.history_from = [], 0, apply_at
            return
        if self.history_bytes + size > self.history_budget_bytes:
            # Forget rather than run out of memory (a run checkpointing rarely, or never after its
            # baseline, would hold a copy of the model every H steps): no replay can start before
            # this outer step now, which check_history says if one is asked for.
            log.warning("the outer steps since step %d take more than sync.replay_history_mb = %d MiB: forgotten; "
                        "a pod that fails before this pod's next checkpoint cannot be replayed (checkpoint "
                        "more often, or raise sync.replay_history_mb)", self.history_from,
                        self.history_budget_bytes >> 20)
            self.history, self.history_bytes, self.history_from = [], 0, apply_at
            return
        values = [host_value(v) for v in agreed]
        self.history.append((sync, apply_at, fragment, values))
        self.history_bytes += size

    def replay_merges(self, replica: Replica) -> None:
        """After the replica's inner step (its count = replica.step): its pseudo-gradient of a sync
        starting now that this pod has not applied yet, then the merge of an outer step this pod
        applied at that count (from the history)."""
        count = replica.step
        sync = self.sync_at(count)
        if sync is not None and sync > self.applied:
            replica.deltas[sync] = self.replica_delta(replica, sync)
        for _sync, apply_at, fragment, values in self.history:
            if apply_at == count:
                self._merge(replica, fragment, [jax.device_put(v, self._shardings[i])
                                                for v, i in zip(values, self.fragments[fragment])])

    def check_history(self, since: int) -> None:
        """ValueError unless the outer steps since `since` inner steps are all in the history."""
        if self.history_from is None:
            raise ValueError(f"this pod has saved no checkpoint, so it keeps no outer steps; a replay from step "
                             f"{since} needs them")
        if since < self.history_from:
            raise ValueError(f"this pod keeps the outer steps since step {self.history_from} only (the older ones "
                             f"went beyond sync.replay_history_mb, or before its checkpoint before last), a replay "
                             f"from step {since} needs them all")

    def trim_history(self, keep_from: int) -> None:
        """Forget the outer steps applied at or before `keep_from` inner steps (no replay starts before
        it); the first call (at this pod's first save) starts the history."""
        if self.history_from is None or keep_from > self.history_from:
            self.history = [entry for entry in self.history if entry[1] > keep_from]
            self.history_bytes = sum(v.nbytes for entry in self.history for v in entry[3])
            self.history_from = keep_from

    def adopt(self, replica: Replica) -> None:
        """Host `replica` from now on: its pseudo-gradient joins the pending sync's if that one has
        not been exchanged yet (its exchange failed: it is exchanged again with it)."""
        self.replicas[replica.slot] = replica
        pending = self.pending
        if pending is not None and pending.sync in replica.deltas:
            pending.extra = {**pending.extra, replica.slot: replica.deltas[pending.sync]}

    def release(self, slots) -> None:
        """Stop hosting the replicas of `slots` (their pods are back)."""
        for slot in list(slots):
            self.replicas.pop(slot, None)
            if self.pending is not None:
                self.pending.extra.pop(slot, None)
