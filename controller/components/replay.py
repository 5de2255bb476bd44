"""DiLoCo's "replay" (sync.on_pod_failure): what a survivor needs to rebuild a failed pod's own
state, and asking it to. The pod's own part of the last good checkpoint, and the slot's shards
of the steps since, as the step loop cut them (the same batches: a batch is a function of the
seed and the step); the survivor hosting the slot retakes those inner steps with the outer steps
merged where they were applied (pod_worker/diloco_pod.py adopt_slot), and from then on trains the
slot's replica beside its own shard, so the outer steps stay bitwise the uninterrupted run's."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster
from multipod.controller.core.errors import RunError
from multipod.controller.data.batches import step_data, token_dtype
from multipod.controller.observe.events import EventKind, EventLog
from multipod.controller.observe.metrics import out
from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.controller.core.run_config import Config


class Replayer:
    """Rebuilds failed DiLoCo pods' states on the survivors hosting their slots. `checkpointer`:
    the run's (components/checkpointer.py: last_good, part_path, data_offset); `batches`: the run's
    dataset (batch(index), loss_mask(index))."""

    def __init__(self, cluster: Cluster, checkpointer, batches, events: EventLog):
        self.cluster, self.checkpointer, self.batches, self.events = cluster, checkpointer, batches, events
        self.replays = 0

    def replay(self, slot: int, step: int, timeout_s: float) -> None:
        """Have the pod hosting failed slot `slot` rebuild its state up to `step` (every survivor's
        step) and host it. RunError (naming why) if it cannot: no checkpoint yet, or the host
        refuses."""
        saved = self.checkpointer.last_good
        if saved is None:
            raise RunError(f"slot {slot} cannot be replayed: the run has no checkpoint yet (sync.on_pod_failure = "
                           f"\"replay\" starts from the failed pod's own part of the last one)")
        host = self.cluster.hosts[slot]
        dtype = token_dtype(self.cluster.config.model.vocab_size)
        offset, size = self.checkpointer.data_offset, self.cluster.size
        tokens = [step_data(self.batches.batch(i + offset), self.batches.loss_mask(i + offset), size,
                            dtype).tokens[slot] for i in range(saved.step, step)]
        request = pb.AdoptSlotRequest(slot=slot, checkpoint_path=self.checkpointer.part_path(slot, saved),
                                      tokens=tokens)
        start = time.monotonic()
        try:
            reply = self.cluster.clients[host].adopt_slot(request, timeout_s)
        except WorkerError as exc:
            raise RunError(f"pod {host} could not replay slot {slot} from step {saved.step}: {exc}") from None
        seconds = time.monotonic() - start
        self.replays += 1
        out(f"replay: pod {host} retook slot {slot}'s {step - saved.step} inner step(s) from its checkpoint of step "
            f"{saved.step} in {seconds:.2f}s and trains it from step {step}")
        self.events.write(EventKind.REPLAY, slot=slot, host=host, from_step=saved.step, to_step=step,
                          seconds=seconds, fingerprint=reply.fingerprint)

    def adopt_again(self, step: int, timeout_s: float) -> None:
        """After a restore while pods are out (a loss-spike rewind or a recovery in a degraded
        run): the restore left the survivors without their replicas, so each failed slot is adopted
        again from its part of the checkpoint just restored (the last good one, at `step`: nothing
        to retake), and the run goes on degraded as before. Nothing with "drop" or no pod out."""
        if self.cluster.config.sync.on_pod_failure != "replay":
            return
        for slot in (s for s, host in enumerate(self.cluster.hosts) if host != s):
            self.replay(slot, step, timeout_s)


def history_warning(config: Config, param_count: int) -> str | None:
    """Before a DiLoCo run with sync.on_pod_failure = "replay": a warning if, at this checkpoint
    interval, the replay history (the agreed values of every outer step since a pod's checkpoint
    before last, which each pod keeps in host memory: pod_worker/diloco_replicas.py) will outgrow
    sync.replay_history_mb. Past the bound a pod forgets it, and a pod that dies before the next
    checkpoint cannot be replayed. None if it fits, or if nothing is replayed."""
    sync = config.sync
    if not sync.diloco or sync.on_pod_failure != "replay" or param_count <= 0:
        return None
    every, steps = config.checkpoint.every, config.run.steps
    span = min(2 * every, steps) if every else steps     # inner steps whose outer steps a pod may hold
    fragment_bytes = param_count * np.dtype(config.model.weight_dtype).itemsize / sync.fragments
    need = span // sync.period * fragment_bytes          # one fragment's values per outer step
    budget = sync.replay_history_mb << 20
    if need <= budget:
        return None
    fits = int(budget // fragment_bytes) * sync.period   # the inner steps whose outer steps fit in the bound
    why = (f"checkpoints every {every} steps keep up to {span}" if every else
           f"with no checkpoint but the first (checkpoint.every = 0) it spans the run's {span} steps")
    return (f"sync.replay_history_mb = {sync.replay_history_mb} holds the outer steps of about {fits} inner steps "
            f"per pod; {why}, about {need / 2**20:,.0f} MiB of host memory per pod. Past the bound a pod "
            f"forgets them, and a pod that dies before the next checkpoint cannot be replayed. Save every "
            f"{max(1, fits // 2)} steps or fewer (--checkpoint-every), or raise sync.replay_history_mb to "
            f"{int(need / 2**20) + 1}")
