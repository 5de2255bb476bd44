"""A pod's checkpoints, a mixin of Pod (pod.py): start an orbax save of the state (the pod steps
on while it is written), wait for it, and restore one (the newest under a directory, or a path),
checked against its fingerprint before anything uses it. A failed or refused restore leaves the
state, and the DCN link, as they were; a restore starts a new timeline at its step.

In DiLoCo mode a checkpoint is one part per pod, each pod's own state. While a pod is out
(degraded mode) a survivor writes the failed slot's part on its behalf (`slot`): with
sync.on_pod_failure = "replay" the replica of it that this pod hosts, with "drop" a copy of this
pod's own state, which is what that pod takes when it rejoins from a live peer."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from multipod.pod_worker import checkpoint, checkpoint_parts
from multipod.pod_worker.checkpoint import CheckpointError
from multipod.pod_worker.diloco_pod import OuterLink
from multipod.pod_worker.errors import Busy, CorruptCheckpoint, InvalidRequest, SaveNotFound, SavePending
from multipod.pod_worker.hosts import meet
from multipod.pod_worker.schema import OuterFailure
from multipod.pod_worker.trainer import PodTrainer, fingerprint
from multipod.protos import multipod_pb2 as pb


@dataclasses.dataclass(frozen=True)
class SaveStarted:
    path: pathlib.Path
    fingerprint: str
    step: int


@dataclasses.dataclass(frozen=True)
class Restored:
    path: str
    step: int
    fingerprint: str
    metadata: dict
    skipped: tuple[checkpoint_parts.Skipped, ...] = ()   # from a directory: newer checkpoints not whole
    warm_start: bool = False    # DiLoCo: an every-step checkpoint, the outer state started afresh from it


def _state_fingerprint(state: dict) -> str:
    """The fingerprint of everything a checkpoint holds (a DiLoCo pod's outer state too)."""
    return fingerprint(state["params"], state["opt_state"], state.get("outer", {}))


def _newer_diloco(diloco: tuple[int, str], every_step: int | None) -> CheckpointError:
    """The refusal of an every-step resume where a DiLoCo run of the same directory saved later."""
    step, where = diloco
    offered = f"its newest every-step checkpoint is of step {every_step}" if every_step is not None \
        else "it holds no whole every-step checkpoint"
    return CheckpointError(
        f"a DiLoCo run saved a checkpoint of step {step} in {where}, and {offered}: resuming with every-step "
        f"sync would go back past the DiLoCo run's work. Resume it with sync.mode = \"diloco\" and the "
        f"settings it was trained with, or start afresh in another run directory")


class CheckpointPod:
    """The checkpoint part of Pod: it works on Pod's state (setup, writer, exchange, sequencer)."""

    def start_save(self, step: int, directory: str, metadata: dict, keep: int, deadline: float,
                   slot: int | None = None) -> SaveStarted:
        """Start writing the state after `step` steps with orbax's asynchronous checkpointing,
        waiting until `deadline` for a running step or for the previous save under `directory`
        to finish writing (Busy): the pod may step on as soon as this returns (orbax has its host
        copy of this host's shards). Every host of a pod gets the same request and takes part.
        `slot` (DiLoCo, a pod out): write failed slot `slot`'s part instead of this pod's own
        (`_part`); InvalidRequest, naming why, if this pod cannot."""
        self.setup()
        try:
            self._writer.wait_idle(directory, deadline - time.monotonic())
        except TimeoutError as exc:
            raise Busy(f"pod {self.pod_index}: {exc}") from None
        with self.seq.hold("a save's host copy", deadline):
            setup = self.setup()
            trainer = setup.trainer
            if step != trainer.step:
                raise InvalidRequest(f"save requested for step {step}, pod {self.pod_index} is at step {trainer.step}")
            metadata = dict(metadata, worker_config=setup.config.to_dict(), state_key=setup.config.state_key(),
                            **trainer.save_metadata())
            # The device arrays themselves: orbax copies what this host owns before submit returns.
            params, opt_state, part = self._part(setup, slot)
            state = {"params": params, "opt_state": opt_state, "step": trainer.step}
            if part is not None:
                metadata["part"] = part
            if trainer.outer is not None:   # DiLoCo: this pod's own inner state, and the outer state
                if self.layout.multi and trainer.outer.pending is not None:
                    # The pending sync's sum is gathered over the pod's hosts for the checkpoint (a
                    # collective, OuterSync.checkpoint): every host takes this save, or none gathers.
                    # A slot's part is another save at the same step: a key of its own.
                    wait = min(setup.config.dcn.timeout_s, deadline - time.monotonic())
                    key = f"{setup.run_id}/{setup.epoch}/{step}/save" + ("" if part is None else f"/{slot}")
                    try:
                        meet(key, max(0.1, wait), "save")
                    except TimeoutError as exc:
                        raise Busy(f"{self.layout.name(self.pod_index)}: {exc}") from None
                # The same outer state in every part of the checkpoint: a pending sync is waited for
                # once and its sum saved in each (OuterSync.checkpoint keeps it). One whose exchange
                # a pod's death broke is exchanged again on the current link, as its step would:
                # every live pod gets this save at the same step boundary.
                link = OuterLink(self.exchange, setup, self.pod_index) if setup.num_pods > 1 else None
                state["outer"], metadata["outer"] = trainer.outer.checkpoint(setup.config.dcn.timeout_s, link)
            fp = _state_fingerprint(state)
            path = self._writer.submit(directory, state, fp, json.dumps(metadata), keep or None)
            if trainer.outer is not None and getattr(self, "_saved_at", None) != step:
                # A replay starts from the last good checkpoint: this one, or the one before if it
                # fails. Once per step: the parts a pod writes for failed slots are the same checkpoint.
                trainer.outer.trim_history(getattr(self, "_saved_at", step))
                self._saved_at = step
        return SaveStarted(path, fp, step)

    def _part(self, setup, slot: int | None) -> tuple[object, object, dict | None]:
        """(parameters, optimizer state, the part's record for the metadata or None) of the inner
        state a save writes: this pod's own, or (DiLoCo, a pod out) failed slot `slot`'s, which
        a survivor writes on its behalf so that the checkpoint is whole: the replica of it this pod
        hosts ("replay": that pod's state at this step, as the uninterrupted run has it), or with
        "drop" a copy of this pod's own state, which is what that pod takes when it rejoins from a
        live peer (membership.send_state: host_state). Between steps (a sequencer hold)."""
        trainer = setup.trainer
        trainer.require_state("save")
        if slot is None or slot == self.pod_index:
            return trainer.params, trainer.opt_state, None
        if trainer.outer is None:
            raise InvalidRequest(f"pod {self.pod_index} was asked to save slot {slot}'s part: only a DiLoCo pod "
                                 f"(sync.mode = \"diloco\") writes a part for another slot")
        if not 0 <= slot < setup.num_pods:
            raise InvalidRequest(f"slot {slot} is not a slot of this run of {setup.num_pods} pods")
        if setup.hosts is None or setup.hosts[slot] == slot:
            raise InvalidRequest(f"pod {self.pod_index} was asked to save slot {slot}'s part, but pod {slot} is live "
                                 f"(hosts {list(setup.hosts) if setup.hosts else 'all healthy'}): it writes its own")
        if setup.config.sync.on_pod_failure == OuterFailure.DROP:
            return trainer.params, trainer.opt_state, {"slot": slot, "written_by": self.pod_index,
                                                       "source": "copy of a live pod (drop)"}
        replica = trainer.outer.replicas.get(slot)
        if replica is None:
            raise InvalidRequest(f"pod {self.pod_index} does not host slot {slot}'s replica (it hosts "
                                 f"{sorted(trainer.outer.replicas) or 'none'}; slot {slot} is on pod "
                                 f"{setup.hosts[slot]}): with sync.on_pod_failure = \"replay\" a failed slot's "
                                 f"part is its replica's state, written by the pod hosting it")
        if replica.step != trainer.step:    # they step together; anything else would be a torn checkpoint
            raise InvalidRequest(f"slot {slot}'s replica is at step {replica.step}, pod {self.pod_index} at step "
                                 f"{trainer.step}: its part would not be of this checkpoint")
        return replica.params, replica.opt_state, {"slot": slot, "written_by": self.pod_index, "source": "replica"}

    def wait_save(self, directory: str, step: int, timeout_s: float) -> pathlib.Path:
        """The path of the finished save of `step`: SavePending if still being written after
        timeout_s, SaveNotFound if never started here, CheckpointError if it failed."""
        self.setup()
        try:
            return self._writer.wait(directory, step, max(0.0, timeout_s))
        except KeyError as exc:
            raise SaveNotFound(str(exc.args[0])) from None
        except TimeoutError as exc:
            raise SavePending(str(exc)) from None

    def restore(self, path: str | None, directory: str | None, run_id: str, deadline: float,
                parts: tuple[str, ...] = (), before: int = 0, warm_start_directory: str = "",
                warm_start: bool = False, diloco_directories: tuple[str, ...] = ()) -> Restored:
        """Load checkpoint `path`, or the newest one under `directory` that every folder of `parts`
        (the checkpoint's other parts) also holds whole, older than `before` if not 0
        (checkpoint_parts.newest_whole; the newer ones passed over are in Restored.skipped),
        waiting until `deadline` for a running step (Busy). A new timeline starts at its step:
        steps that arrived before are refused; with `run_id`, the DCN exchange starts afresh under
        it. A checkpoint that does not fit, cannot be read, or is corrupt changes nothing.

        DiLoCo warm start: with `warm_start` the checkpoint at `path` is an every-step one, whose
        parameters the outer state starts from (_restore); with `warm_start_directory`, the newest
        checkpoint there is restored that way if `directory` and `parts` hold none at all yet.
        Every-step sync: a finished checkpoint in `diloco_directories` (a DiLoCo run's folders in
        the same directory) newer than the one `directory` offers refuses the restore, so that a
        resume never silently goes back past a DiLoCo run's work."""
        if path:
            return self._restore_path(path, run_id, deadline, warm_start)
        warm = bool(warm_start_directory) and not checkpoint_parts.holds_any([str(directory), *parts])
        if warm:
            if not checkpoint_parts.holds_any([warm_start_directory]):
                raise CheckpointError(f"no checkpoint to resume from: none in {directory}"
                                      + (f" (and its parts {', '.join(parts)})" if parts else "")
                                      + f", nor an every-step one in {warm_start_directory} to warm-start from")
            directory, parts = warm_start_directory, ()
        skipped: tuple[checkpoint_parts.Skipped, ...] = ()
        diloco = checkpoint_parts.newest_finished(list(diloco_directories)) if diloco_directories else None
        while True:     # each pass looks strictly further back: it ends with a checkpoint or CheckpointError
            try:
                choice = checkpoint_parts.newest_whole(str(directory), list(parts), before)
            except CheckpointError as exc:
                if diloco is not None:
                    raise _newer_diloco(diloco, None) from exc
                raise
            if diloco is not None and diloco[0] > choice.step:
                raise _newer_diloco(diloco, choice.step)
            try:
                restored = self._restore_path(str(choice.path), run_id, deadline, warm)
            except CorruptCheckpoint as exc:    # this pod's own part of it cannot be read back: an older one
                problem = checkpoint_parts.Problem(str(directory), pb.PART_STATE_CORRUPT, str(exc))
                skipped += choice.skipped + (checkpoint_parts.Skipped(choice.step, (problem,)),)
                before = choice.step
                continue
            return dataclasses.replace(restored, skipped=skipped + choice.skipped)

    def _restore_path(self, path: str, run_id: str, deadline: float, warm_start: bool = False) -> Restored:
        """restore() of checkpoint `path` (`warm_start`: an every-step one, in DiLoCo mode)."""
        setup = self.setup()
        metadata = checkpoint.read_metadata(path)
        key = setup.config.state_key()
        if warm_start:
            if setup.trainer.outer is None:
                raise InvalidRequest("a warm start is for a pod in DiLoCo mode (sync.mode = \"diloco\"); "
                                     "this pod syncs every step")
            if "outer" in metadata:
                raise CheckpointError(f"checkpoint {path} holds a DiLoCo outer state: a warm start takes an "
                                      f"every-step checkpoint; resume this one as it is")
            key.pop("sync", None)       # an every-step checkpoint's key has no sync settings
        checkpoint.check_compatible(path, metadata, key)
        setup.trainer.check_restorable(path, metadata)
        aborted = None
        if run_id and self.exchange is not None:
            # A step stuck waiting on a dead peer fails now, not at the DCN deadline: the restore
            # builds a new exchange under run_id anyway.
            aborted = self.exchange.run_id
            self.exchange.abort(f"pod {self.pod_index}: restoring a checkpoint")
        try:
            return self._restore(setup, path, run_id, deadline, warm_start)
        except BaseException:
            if aborted is not None and self.exchange is not None and self.exchange.run_id == aborted:
                # Refused: the pod keeps a working link under its old run id, as it was.
                old, self.exchange = self.exchange, self._new_exchange(
                    aborted, setup.trainer, setup.config, self._peers, self.setup().hosts)
                old.close()
            raise

    def _read_checkpoint(self, trainer: PodTrainer, path: str, warm_start: bool = False) -> tuple[dict, dict]:
        """(state, metadata) of the checkpoint at `path`, read straight onto this host's devices
        laid out as `trainer`'s state (orbax reshards a checkpoint written by another device or
        host count), and checked against its fingerprint before anyone uses it (CorruptCheckpoint).
        `warm_start`: an every-step checkpoint, read without an outer state."""
        # The state's layout, not the state: a pod configured to generate holds none before this.
        target = {**trainer.state_abstract, "step": trainer.step}
        if trainer.outer is not None and not warm_start:
            saved = checkpoint.read_metadata(path).get("outer")
            if not isinstance(saved, dict):
                raise CheckpointError(f"checkpoint {path} holds no DiLoCo outer state (sync.mode = \"diloco\")")
            target["outer"] = trainer.outer.restore_target(saved)
        try:
            state, metadata = checkpoint.restore(path, checkpoint.abstract(target))
        except checkpoint.UnreadableCheckpoint as exc:   # corrupt: a typed answer (DATA_LOSS), not a misfit
            raise CorruptCheckpoint(str(exc)) from None
        if int(state["step"]) != int(metadata.get("step", -1)):
            raise CheckpointError(f"checkpoint {path}: state is at step {state['step']}, "
                                  f"metadata says {metadata.get('step')}")
        fp = _state_fingerprint(state)
        if metadata.get("fingerprint") != fp:
            raise CorruptCheckpoint(f"checkpoint {path} is corrupt: the restored state's fingerprint {fp} "
                                    f"!= the fingerprint saved with it {metadata.get('fingerprint')}")
        return state, metadata

    def _restore(self, setup, path: str, run_id: str, deadline: float, warm_start: bool = False) -> Restored:
        with self.seq.hold("a restore", deadline, state=pb.WORKER_STATE_RESTORING):
            setup = self.setup()
            trainer = setup.trainer
            state, metadata = self._read_checkpoint(trainer, path, warm_start)
            fp = metadata["fingerprint"]
            trainer.load_state(state["params"], state["opt_state"], state["step"])
            if trainer.outer is not None:
                if warm_start:   # every pod read the same state: the agreed values start as its parameters
                    trainer.outer.start_from(trainer.params, trainer.step)
                else:
                    trainer.outer.load(state["outer"], metadata["outer"], trainer.step)
                # The history starts afresh at the restored checkpoint, now the last good one: the
                # next save trims from here, not from a save of the abandoned timeline.
                self._saved_at = trainer.step
                fp = trainer.fingerprint()      # what every pod restored alike: the agreed state's
            self._checksum = (trainer.step, trainer.checksum())
            if run_id:
                # A fresh DCN inbox under a new run id: nothing a peer sent before the restore
                # (streams of the abandoned timeline) can be taken for a step of the new one.
                exchange = self._new_exchange(run_id, trainer, setup.config, self._peers, setup.hosts)
                self.exchange.close()
                self.exchange = exchange
            self.exchange.inbox.set_next_step(trainer.exchange_key)
            epoch = self.seq.reset(trainer.step, "restored to a checkpoint")
            self._setup = dataclasses.replace(setup, epoch=epoch, run_id=run_id or setup.run_id)
        return Restored(path=path, step=trainer.step, fingerprint=fp, metadata=metadata, warm_start=warm_start)
