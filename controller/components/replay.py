"""DiLoCo's "replay" (sync.on_pod_failure): what a survivor needs to rebuild a failed pod's own
state, and asking it to. The pod's own part of the last good checkpoint, and the slot's shards
of the steps since, as the step loop cut them (the same batches: a batch is a function of the
seed and the step); the survivor hosting the slot retakes those inner steps with the outer steps
merged where they were applied (pod_worker/diloco_pod.py adopt_slot), and from then on trains the
slot's replica beside its own shard, so the outer steps stay bitwise the uninterrupted run's."""
from __future__ import annotations

import time

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster
from multipod.controller.core.errors import RunError
from multipod.controller.data.batches import step_data, token_dtype
from multipod.controller.observe.events import EventKind, EventLog
from multipod.controller.observe.metrics import out
from multipod.protos import multipod_pb2 as pb


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
