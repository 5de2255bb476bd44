"""A PodTrainer's DiLoCo part (sync.mode = "diloco"), a mixin of PodTrainer (trainer.py): the outer
sync it starts and steps after the inner steps (pod_worker/diloco.py OuterSync) and its programs
run once at configure (pod_worker/diloco_warmup.py), the snapshot that undoes a step whose outer
exchange failed, the replay of a failed pod's inner steps on a Replica (sync.on_pod_failure =
"replay"), and what the other parts read of the agreed state (the exchange key, the agreed
parameters, the outer arrays a checkpoint or a rejoining peer takes)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from multipod.pod_worker import programs
from multipod.pod_worker.diloco import OuterReport, OuterSync, Replica
from multipod.pod_worker.errors import InvalidRequest
from multipod.pod_worker.outcome import StepOutcome
from multipod.pod_worker.shared_programs import shared


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@shared
def _state_copy_program(param_sharding, opt_sharding):
    """The snapshot's copy of (params, opt_state) laid out so: one per layout (shared_programs)."""
    return jax.jit(lambda params, opt_state: (_copy(params), _copy(opt_state)),
                   out_shardings=(param_sharding, opt_sharding))


class DilocoTrainer:
    """The DiLoCo part of PodTrainer: it works on PodTrainer's state (params, opt_state, step,
    outer) and programs (train_step)."""

    outer: OuterSync | None     # set by start_outer; None outside DiLoCo mode

    def start_outer(self, num_pods: int) -> None:
        """DiLoCo mode (sync.mode = "diloco") for a run of num_pods pods: from now on the steps are
        inner steps and the outer syncs of pod_worker/diloco.py follow them (outer_step). On a pod
        of several hosts each host exchanges its blocks of a fragment (pod_worker/diloco_hosts.py)."""
        self.outer = OuterSync(self.config.sync, self.params, self.param_sharding, self.scalar_sharding,
                               self.config.model.n_layers, num_pods, self.assembler)
        self._outer_checksum = programs.checksum_program(
            *jax.tree.map(lambda leaf: leaf.sharding, self.outer.agreed_state()), out_sharding=self.scalar_sharding)
        # The snapshot's copy, one program warmed up with the outer ones: eager copies compiled at
        # their first use (the optimizer's step count's at the first outer sync), and warmed up
        # eagerly by two in-process pods at once they deadlocked in XLA CPU (c24798d).
        self._state_copy = _state_copy_program(self.param_sharding, self.opt_sharding)

    def warm_up_outer(self) -> None:
        """DiLoCo, after start_outer: run every fragment's outer programs once, on throwaway inputs
        (pod_worker/diloco_warmup.py), so that they compile at configure (as PodTrainer.warm_up's
        programs do) rather than at each fragment's first outer sync, on every pod at once, and
        the snapshot's copy program, which the first step that waits for an outer exchange would
        compile. No state changes."""
        self.outer.warm_up(self.params, self._outer_checksum)
        jax.block_until_ready(self._state_copy(self.params, self.opt_state))

    def outer_step(self, all_reduce) -> OuterReport | None:
        """DiLoCo: after an inner step, the outer step due now (if any) and the start of the outer
        sync due now (pod_worker/diloco.py); the report of an outer step applied."""
        self.params, report = self.outer.after_step(self.step, self.params, all_reduce)
        return report

    def snapshot(self) -> tuple:
        """A copy of the trainer's state (on the devices; with the DiLoCo replicas it hosts) that
        restore_snapshot puts back: what a DiLoCo step that waits for an outer exchange keeps, so
        that it can be undone (DiLoCo mode: after start_outer)."""
        replicas = {}
        for slot, r in self.outer.replicas.items():
            params, opt_state = self._state_copy(r.params, r.opt_state)
            replicas[slot] = dataclasses.replace(r, params=params, opt_state=opt_state, deltas=dict(r.deltas))
        params, opt_state = self._state_copy(self.params, self.opt_state)
        return params, opt_state, self.step, getattr(self, "_count", None), replicas

    def restore_snapshot(self, snapshot: tuple) -> None:
        self.params, self.opt_state, self.step, self._count, replicas = snapshot
        if self.outer is not None:
            self.outer.replicas = replicas

    def inner_step_on(self, replica: Replica, batch: jax.Array) -> StepOutcome:
        """DiLoCo: one inner step of a failed pod's replica (pod_worker/diloco.py Replica) on its
        shard, by this trainer's own programs, as that pod would have taken it; the trainer's own
        state is put back afterwards, whatever happens."""
        own = (self.params, self.opt_state, self.step, getattr(self, "_count", None))
        self.params, self.opt_state, self.step, self._count = (replica.params, replica.opt_state, replica.step,
                                                               replica.count)
        try:
            outcome = self.train_step(batch, self.target_count(batch), None)
            replica.params, replica.opt_state, replica.step, replica.count = (self.params, self.opt_state, self.step,
                                                                              self._count)
        finally:
            self.params, self.opt_state, self.step, self._count = own
        return outcome

    def replay(self, slot: int, params, opt_state, step: int, batches: list[np.ndarray]) -> Replica:
        """DiLoCo, sync.on_pod_failure = "replay": rebuild failed pod `slot`'s state from its
        checkpoint part (params, opt_state after `step` steps) by retaking its inner steps on
        `batches` (its shards of steps step, step+1, ...) with the outer steps merged where this
        pod applied them (its history), then host it. ValueError if the history does not reach
        back to `step` or the batches do not bring it to this pod's step."""
        self.outer.check_history(step)
        if step + len(batches) != self.step:
            raise ValueError(f"a replay from step {step} with {len(batches)} batches ends at step "
                             f"{step + len(batches)}, this pod is at step {self.step}")
        replica = Replica(slot, jax.device_put(params, self.param_sharding),
                          jax.device_put(opt_state, self.opt_sharding), int(step))
        # The batches are the slot's whole shards; a host of a pod of several puts its row block
        # on its devices, as the controller cuts a step's shards.
        k, h = self.layout.hosts_per_pod, self.layout.host_index
        for tokens in batches:
            rows = len(tokens) // k
            self.inner_step_on(replica, self.put_batch(tokens[h * rows:(h + 1) * rows]))
            self.outer.replay_merges(replica)
        self.outer.adopt(replica)
        return replica

    @property
    def exchange_key(self) -> int:
        """The key of the next exchange on the data plane (Inbox.set_next_step): the next step, or
        in DiLoCo mode the number of the next outer sync."""
        return self.step if self.outer is None else self.outer.next_sync(self.step)

    @property
    def agreed_params(self):
        """The parameters every pod holds alike: the trained ones, or in DiLoCo mode the agreed
        ones (each fragment as of its last outer step). Evaluation and generation use these."""
        return self.params if self.outer is None else self.outer.agreed_params()

    def outer_arrays(self) -> dict:
        """DiLoCo: the agreed parameters and outer optimizer states as a checkpoint holds them
        (OuterSync.checkpoint), refused while a sync is pending (InvalidRequest: a peer's state is
        taken only between outer syncs); {} in every-step mode."""
        if self.outer is None:
            return {}
        if self.outer.pending is not None:
            raise InvalidRequest(f"outer sync {self.outer.pending.sync} is pending after step {self.step}: the state "
                                 f"moves between pods only at an outer boundary")
        return self.outer.checkpoint(0.0)[0]
