"""A DiLoCo pod's steps (sync.mode = "diloco"), a mixin of Pod (pod.py): the inner step with the
outer step due after it (pod_worker/diloco.py), the outer exchange on the pod's data plane, and
the replay of a failed pod's inner steps (sync.on_pod_failure = "replay").

A failed pod's slot, in a DiLoCo run, is hosted by a survivor (the membership's hosts): with
"drop" it adds zeros in the slot's place and the outer steps average over the live pods; with
"replay" the host rebuilds the failed pod's own state from its checkpoint part (adopt_slot),
trains it on the slot's shards as the pod would have, and contributes its pseudo-gradients in the
slot's place, so the outer steps stay bitwise those of the uninterrupted run."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from multipod.pod_worker.dcn import Exchange, ExchangeStats
from multipod.pod_worker.errors import Busy, InvalidRequest
from multipod.pod_worker.hosts import meet
from multipod.pod_worker.outcome import StepOutcome
from multipod.pod_worker.schema import OuterFailure
from multipod.pod_worker.trainer import fingerprint


class DilocoPod:
    """The DiLoCo part of Pod: it works on Pod's state (setup, exchange, sequencer)."""

    def _train_inner(self, setup, step: int, on_device, take_fingerprint: bool, extra: dict | None,
                     pieces) -> StepOutcome:
        """DiLoCo (sync.mode): an inner step on this pod's own shard (its loss normalised by the
        shard's own tokens; no DCN traffic), and one on each hosted replica's shard (`extra`), then
        the outer step and the outer sync due now (trainer.outer_step; the sync's exchange runs on
        the data plane, keyed by its number). A step that waits for an outer exchange is undone if
        the exchange fails (the state as it was; the controller retries it after a change of
        membership, which exchanges again)."""
        trainer = setup.trainer
        extra = extra or {}
        if pieces or sorted(extra) != sorted(trainer.outer.replicas):
            raise InvalidRequest(f"step {step}: pod {self.pod_index} trains the replicas of slots "
                                 f"{sorted(trainer.outer.replicas)}, the request carries the shards of {sorted(extra)}")
        link = OuterLink(self.exchange, setup, self.pod_index) if setup.num_pods > 1 else None
        before = trainer.snapshot() if trainer.outer.waits_at(trainer.step + 1) else None
        try:
            outcome = trainer.train_step(on_device, trainer.target_count(on_device), None)
            shards = [(None, outcome.loss_sum, outcome.z_loss_sum, outcome.tokens)]
            for slot, batch in sorted(extra.items()):
                got = trainer.inner_step_on(trainer.outer.replicas[slot], batch)
                shards.append((slot, got.loss_sum, got.z_loss_sum, got.tokens))
            start = time.perf_counter()
            report = trainer.outer_step(link)
        except BaseException:
            if before is not None:
                trainer.restore_snapshot(before)
            raise
        stats = None
        if report is not None:
            stats = dataclasses.replace(ExchangeStats(), bytes_sent=report.bytes_sent,
                                        bytes_received=report.bytes_received)
        outcome = dataclasses.replace(
            outcome, checksum=trainer.checksum(), outer=report, link=stats, shards=shards,
            loss_sum=sum(s[1] for s in shards), z_loss_sum=sum(s[2] for s in shards), tokens=sum(s[3] for s in shards),
            update_s=outcome.update_s + time.perf_counter() - start)
        if take_fingerprint:
            fp_start = time.perf_counter()
            outcome.fingerprint = trainer.fingerprint()
            outcome.fingerprint_s = time.perf_counter() - fp_start
        return outcome

    def adopt_slot(self, slot: int, path: str, batches: list[np.ndarray], deadline: float) -> tuple[int, str]:
        """sync.on_pod_failure = "replay": host failed pod `slot`'s replica, rebuilt from its
        checkpoint part at `path` by retaking its inner steps on `batches` (its shards from the
        checkpoint's step to this pod's), with the outer steps merged where they were applied.
        Between steps (waits until `deadline`). Returns (the replica's step, the fingerprint of its
        own state). InvalidRequest if the slot is not one this pod hosts or the replay cannot
        reach this pod's step; the pod's own state never changes."""
        setup = self.setup()
        trainer = setup.trainer
        if trainer.outer is None:
            raise InvalidRequest("only a DiLoCo pod (sync.mode = \"diloco\") hosts a failed pod's replica")
        if slot not in setup.extra_slots(self.pod_index):
            raise InvalidRequest(f"pod {self.pod_index} does not host slot {slot} (hosts "
                                 f"{list(setup.hosts) if setup.hosts else 'all healthy'})")
        with self.seq.hold("a replay of a failed pod's inner steps", deadline):
            setup = self.setup()
            trainer = setup.trainer
            state, _ = self._read_checkpoint(trainer, path)
            if self.layout.multi:
                # The inner steps' programs sum over the pod's hosts: every host takes this replay
                # (its part of the checkpoint read), or none starts it.
                wait = min(setup.config.dcn.timeout_s, deadline - time.monotonic())
                try:
                    meet(f"{setup.run_id}/{setup.epoch}/{trainer.step}/adopt/{slot}", max(0.1, wait), "replay")
                except TimeoutError as exc:
                    raise Busy(f"{self.layout.name(self.pod_index)}: {exc}") from None
            try:
                replica = trainer.replay(slot, state["params"], state["opt_state"], int(state["step"]), batches)
            except ValueError as exc:
                raise InvalidRequest(f"slot {slot}: {exc}") from None
            return replica.step, fingerprint(replica.params, replica.opt_state)


class OuterLink:
    """A DiLoCo pod's outer exchange on one data-plane Exchange (pod_worker/diloco.py calls it):
    (sync, leaves, order, extra) -> (the pod-order sum of the fragment's leaves, stats, the pods
    whose pseudo-gradients it averaged). A failed pod's slot this pod hosts adds its replica's
    pseudo-gradient (`extra`, "replay"), or zeros ("drop"; the mean is then over the live pods)."""

    def __init__(self, exchange: Exchange, setup, pod_index: int):
        self.exchange = self.key = exchange     # key: two links on one exchange are the same link
        self.hosted = setup.extra_slots(pod_index)
        # "replay": every failed slot is a replica on its host, so every slot counts; "drop": the live pods.
        replay = setup.config.sync.on_pod_failure == OuterFailure.REPLAY
        self.pods = tuple(range(setup.num_pods)) if replay or setup.hosts is None else tuple(sorted(set(setup.hosts)))

    def __call__(self, sync: int, leaves: list, order: list[int], extra: dict | None = None):
        self.exchange.inbox.set_next_step(sync)
        slots = dict(extra or {})
        missing = [slot for slot in self.hosted if slot not in slots]
        if missing:
            zeros = [None if leaf is None else np.zeros(leaf.shape, leaf.dtype) for leaf in leaves]
            slots.update({slot: zeros for slot in missing})
        summed, stats = self.exchange.all_reduce(sync, leaves, order=order, subset=True,
                                                 extra=dict(sorted(slots.items())) or None)
        return summed, stats, self.pods
