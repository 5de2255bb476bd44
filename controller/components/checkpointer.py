"""Checkpoint bookkeeping: when to save, the saves in flight, the last good checkpoint, and
restoring every pod from one.

Pod 0 writes each checkpoint (every pod's state is identical) in the background: the `Save` RPC
returns once the state is on the host, and a separate `WaitSave` RPC reports the write's outcome.
A failed save is reported at once and never replaces the last good checkpoint.

In DiLoCo mode (sync.mode) the pods differ between outer steps, so every pod writes its own
state, under `<checkpoint dir>/pod-<k>/<step>` (pod_directory); a checkpoint is good once every
pod's part is written, and each pod restores its own part. While a pod is out (degraded mode), the
pod holding its slot's state (`slot_source`) writes that slot's part on its behalf (SaveRequest.slot):
with sync.on_pod_failure = "replay" the survivor hosting its replica, with "drop" the live pod a
rejoin would copy. So a checkpoint taken in degraded mode is whole, and a run resumed from it with
every pod back continues as the run that took it would have."""
from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster, parallel
from multipod.controller.core.errors import RunError
from multipod.controller.observe.events import EventKind
from multipod.controller.observe.metrics import out
from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.controller.core.run_config import CheckpointConfig
    from multipod.controller.observe.events import EventLog

CHECKPOINT_TIMEOUT_S = 3600.0   # deadline of the wait for one background checkpoint write


@dataclass(frozen=True)
class Saved:
    """A checkpoint known to be complete: the state after `step` steps, at `path`."""
    step: int
    path: str


@dataclass(frozen=True)
class PendingSave:
    """A checkpoint being written: `calls`, the WaitSave RPCs in flight (one per writing pod)."""
    step: int
    path: str
    calls: tuple


def pod_directory(directory: str, pod: int) -> str:
    """DiLoCo mode: where pod `pod` writes its own checkpoints under the run's checkpoint directory."""
    return str(pathlib.Path(directory) / f"pod-{pod}")


def slot_source(cluster: Cluster, slot: int) -> int:
    """The pod holding slot `slot`'s state: its own pod while it is live; for a failed slot, in
    DiLoCo mode with sync.on_pod_failure = "replay" the survivor hosting its replica, else the
    first live pod (every-step mode: every pod's state is the same; "drop": a rejoining pod takes
    a live peer's). A rejoining pod takes its state from this pod, and in DiLoCo mode this pod
    writes the slot's part of a checkpoint while the slot's pod is out."""
    if cluster.hosts[slot] == slot:
        return slot
    sync = cluster.config.sync
    return cluster.hosts[slot] if sync.diloco and sync.on_pod_failure == "replay" else cluster.live[0]


class Checkpointer:
    """Saves every checkpoint.every steps, a baseline at the first step boundary and one at the
    end (run.steps); keeps the newest checkpoint.keep; keeps the last good checkpoint; restores
    the pods from it. `directory`: checkpoint.dir resolved (training.checkpoint_dir)."""

    def __init__(self, config: CheckpointConfig, cluster: Cluster, directory: str, events: EventLog):
        self.config = config
        self.cluster = cluster
        self.directory = directory
        self.events = events
        self.last_good: Saved | None = None
        self.pending: list[PendingSave] = []
        self.failed = 0
        self.data_offset = 0          # batches skipped by rewinds: saved with, and resumed from, a checkpoint
        self._baseline_taken = False

    # -- when to save -----------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the boundary before `step` wants a checkpoint (saved or not yet)."""
        every = self.config.every
        return (not self._baseline_taken or step == self.cluster.config.run.steps
                or bool(every and step % every == 0))

    def covers(self, step: int) -> bool:
        """Whether the state after `step` steps is already saved or being saved."""
        return (self.last_good is not None and self.last_good.step == step) or \
            any(p.step == step for p in self.pending)

    def on_step(self, step: int, drain: Callable[[], None]) -> bool:
        """Called at the boundary before step `step` (and at the end, with run.steps): collect the
        finished saves, and save the state after `step` steps if due. `drain` finishes the steps
        in flight first, so the checkpoint holds exactly that state. True if a save started."""
        self.collect(block=False)
        due = self.due(step) and not self.covers(step)
        self._baseline_taken = True
        if due:
            drain()
            self.save(step)
        return due

    # -- saving -----------------------------------------------------------------------------
    def describe_last_good(self, none: str = "none") -> str:
        return f"{self.last_good.path} (step {self.last_good.step})" if self.last_good else none

    def save(self, step: int) -> None:
        """Start a background checkpoint of the state after `step` steps on the first live pod
        (pod 0 unless it failed); in DiLoCo mode one part per slot, each written by the pod
        holding that slot's state (`slot_source`). A pod that does not answer is a PodFailure; a
        refused save is reported and the run goes on."""
        run = self.cluster.config.run
        meta = {"data_offset": self.data_offset, "data_position": step + self.data_offset,
                "data_path": self.cluster.config.data.path, "seed": run.seed, "run_id": self.cluster.base_run_id,
                "num_pods": self.cluster.size, "saved_at": time.time()}
        parts = self._parts()
        by_writer: dict[int, list[tuple[int, str]]] = {}
        for writer, slot, directory in parts:
            by_writer.setdefault(writer, []).append((slot, directory))

        def start(writer: int) -> dict[int, pb.SaveReply]:
            # One writer's parts one after another, its own first: every host of a pod of several
            # takes them in the same order (a save with a sync pending meets the pod's hosts).
            replies = {}
            for slot, directory in sorted(by_writer[writer], key=lambda part: part[0] != writer):
                request = pb.SaveRequest(step=step, directory=directory, metadata_json=json.dumps(meta),
                                         background=True, keep=self.config.keep)
                if slot != writer:
                    request.slot = slot
                replies[slot] = self.cluster.clients[writer].save(request, run.step_timeout_s)
            return replies
        def attempt(writer: int) -> tuple[dict[int, pb.SaveReply], WorkerError | None]:
            # Every writer's outcome, typed: in DiLoCo mode a pod that dies mid-save fails its
            # peers' saves too (their pending outer exchange breaks), and all of them must be seen.
            try:
                return start(writer), None
            except WorkerError as exc:
                return {}, exc
        outcomes = parallel(attempt, list(by_writer))
        errors = [exc for _, exc in outcomes if exc is not None]
        if errors:
            why = "; ".join(str(exc) for exc in errors)
            if any(exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) for exc in errors):
                raise self.cluster.diagnose(f"checkpoint of step {step}: {why}") from None
            self._failed(step, why)
            return
        started = {slot: reply for replies, _ in outcomes for slot, reply in replies.items()}
        path = started[parts[0][1]].path
        waits = tuple(self.cluster.clients[writer].wait_save_async(pb.WaitSaveRequest(step=step, directory=directory),
                                                                   CHECKPOINT_TIMEOUT_S)
                      for writer, _slot, directory in parts)
        self.pending.append(PendingSave(step, path, waits))
        self.events.write(EventKind.CHECKPOINT_STARTED, step=step, path=path)

    def _parts(self) -> list[tuple[int, int, str]]:
        """(writer pod, slot, directory) of each part of a checkpoint, slot 0's first: pod 0 alone
        (or the first live pod) in every-step mode; in DiLoCo mode every slot, a failed one
        written by the pod holding its state."""
        if not self.per_pod:
            writer = self.cluster.live[0]
            return [(writer, writer, self.directory)]
        return [(slot_source(self.cluster, slot), slot, self._directory(slot)) for slot in range(self.cluster.size)]

    @property
    def per_pod(self) -> bool:
        """Whether every pod writes its own state (DiLoCo mode), not pod 0 alone."""
        return self.cluster.config.sync.diloco

    @property
    def warm_start_directory(self) -> str:
        """DiLoCo --resume with no part saved yet: where the every-step checkpoint to start from is
        (checkpoint.warm_start_from, made absolute as the pods may run elsewhere; else this run's own)."""
        from_elsewhere = self.config.warm_start_from
        return str(pathlib.Path(from_elsewhere).absolute()) if from_elsewhere else self.directory

    def _directory(self, pod: int) -> str:
        """Where pod `pod` writes and finds its checkpoints."""
        return pod_directory(self.directory, pod) if self.per_pod else self.directory

    def _path(self, pod: int, step: int, path: str) -> str:
        """Pod `pod`'s part of the checkpoint of `step` whose (pod 0's) path is `path`."""
        return str(pathlib.Path(self._directory(pod)) / str(step)) if self.per_pod else path

    def part_path(self, pod: int, saved: Saved) -> str:
        """Pod `pod`'s part of the checkpoint `saved` (in DiLoCo mode, its own state)."""
        return self._path(pod, saved.step, saved.path)

    def _failed(self, step: int, why: str) -> None:
        self.failed += 1
        out(f"ERROR: checkpoint of step {step} FAILED: {why}. "
            f"The last good checkpoint is still {self.describe_last_good('none yet')}.")
        self.events.write(EventKind.CHECKPOINT_FAILED, step=step, error=why)

    def collect(self, block: bool) -> None:
        """Collect finished background saves (every one if block): a success becomes the last
        good checkpoint unless a newer one already is; a failure is reported at once."""
        still = []
        for save in self.pending:
            if not block and not all(call.done() for call in save.calls):
                still.append(save)
                continue
            try:
                reply = [call.result() for call in save.calls][0]
            except WorkerError as exc:
                self._failed(save.step, str(exc))
                continue
            path = reply.path or save.path
            if self.last_good is None or save.step >= self.last_good.step:
                self.last_good = Saved(save.step, path)
            self.events.write(EventKind.CHECKPOINT_SAVED, step=save.step, path=path)
        self.pending = still

    # -- restoring --------------------------------------------------------------------------
    def restore(self) -> int:
        """Restore every pod to the last good checkpoint; returns its step."""
        if self.last_good is None:
            raise RunError("no checkpoint to restore")
        return self._restore(path=self.last_good.path)

    def resume(self) -> int:
        """Restore every pod to the newest whole checkpoint in the directory (in DiLoCo mode, one
        every pod's part of which is complete and readable; a newer one that is not is skipped,
        saying why), refusing one trained on other data; the data offset continues from it.
        Returns its step.

        In DiLoCo mode with no part saved yet, the newest checkpoint of an every-step run in the
        same directory (or in checkpoint.warm_start_from) is taken instead (a warm start): every pod
        restores it, the outer state starts afresh from its parameters, and a baseline of the DiLoCo
        run is saved at once."""
        return self._restore(directory=self.directory)

    def _restore(self, path: str = "", directory: str = "") -> int:
        from multipod.controller.core.run_config import ConfigError  # here: importing config imports jax
        before = 0
        skipped: list[dict] = []    # (with directory) the newer checkpoints passed over, and why
        while True:
            try:
                replies, path = self._restore_once(path, directory, before, skipped)
                break
            except _PartUnreadable as exc:
                # Another pod could not read its part of the checkpoint the first pod chose (its
                # arrays are not the ones written): take the newest whole one before it instead.
                # Each retry looks strictly further back, and the first pod's choice fails once none is left.
                before = exc.step
                out(f"resume: skipping the checkpoint of step {exc.step}, it is not whole: pod {exc.pod}'s part is "
                    f"corrupt ({exc.error})")
                skipped.append({"step": exc.step, "parts": {str(exc.pod): "corrupt"}})
        meta = json.loads(replies[0].metadata_json)
        step = int(replies[0].step)
        warm = replies[0].warm_start
        if directory:
            data_path = self.cluster.config.data.path
            if meta.get("data_path", "") != data_path:
                raise ConfigError("data.path", f"checkpoint {path} was trained on "
                                  f"{meta.get('data_path') or 'the default corpus'!r}, "
                                  f"this run reads {data_path or 'the default corpus'!r}")
            self.data_offset = int(meta.get("data_offset", 0))
        if warm:
            # Not a checkpoint of this DiLoCo run: the first step boundary saves its baseline, which
            # a rewind or a replay then starts from.
            self.last_good, self._baseline_taken = None, False
            out(f"DiLoCo warm start: every pod took the every-step checkpoint {path} (step {step}, data position "
                f"{step + self.data_offset}); the outer state starts afresh from its parameters")
        else:
            self.last_good = Saved(step, path)
        left_out = self._parts_left_out(step) if directory and not warm else []
        if left_out:
            size, names = self.cluster.size, ", ".join(map(str, left_out))
            kept = "pod 0 goes on from its own part" if size == 1 else \
                f"pods 0-{size - 1} go on from their own parts"
            dropped = f"pod {names}'s part is left out, with the steps it took since its last outer step" \
                if len(left_out) == 1 else \
                f"the parts of pods {names} are left out, with the steps they took since their last outer step"
            out(f"resume: the checkpoint of step {step} holds parts of more pods than this run's {size}: {kept}; "
                f"{dropped}; the outer steps average over {size} pod(s) from here")
        self.events.write(EventKind.RESTORED, step=step, path=path, data_offset=self.data_offset,
                          fingerprint=replies[0].fingerprint, **({"warm_start": True} if warm else {}),
                          **({"skipped": skipped} if skipped else {}),
                          **({"parts_left_out": left_out} if left_out else {}))
        return step

    def _parts_left_out(self, step: int) -> list[int]:
        """DiLoCo mode: the pods beyond this run's whose part of the checkpoint of `step` exists
        (the run that saved it had more pods)."""
        if not self.cluster.config.sync.diloco:
            return []
        pods = [int(p.name[4:]) for p in pathlib.Path(self.directory).glob("pod-*")
                if p.name[4:].isdigit() and (p / str(step)).is_dir()]
        return sorted(pod for pod in pods if pod >= self.cluster.size)

    def _restore_once(self, path: str, directory: str, before: int, skipped: list[dict]) -> tuple[list, str]:
        """Every live pod restored to one checkpoint: `path`, or (with `directory`) the newest
        whole one before step `before` (0: any), which the first live pod chooses; the newer ones
        it passed over are reported and added to `skipped`. (replies, the first part's path).
        _PartUnreadable if another pod's part of the chosen one is corrupt. In DiLoCo mode the
        first pod may choose an every-step checkpoint instead (RestoreReply.warm_start, resume):
        the others then restore that same one."""
        clients = self.cluster.live_clients       # in degraded mode the failed pods rejoin later
        run_id = self.cluster.next_generation()    # the pods' DCN links start afresh
        timeout = self.cluster.config.run.step_timeout_s + self.cluster.config.dcn.timeout_s + 60.0
        first = []
        if directory:   # the first pod chooses the newest whole checkpoint; the others restore that one
            own = clients[0].pod_index
            parts = [self._directory(k) for k in range(self.cluster.size) if k != own] if self.per_pod else []
            # Every-step sync refuses to go back past a DiLoCo run's newer checkpoint in the same directory.
            diloco = [] if self.per_pod else [pod_directory(self.directory, k) for k in range(self.cluster.size)]
            first = [clients[0].restore(pb.RestoreRequest(
                directory=self._directory(own), parts=parts, before_step=before, run_id=run_id,
                warm_start_directory=self.warm_start_directory if self.per_pod else "",
                diloco_directories=diloco), timeout)]
            path = first[0].path
            skipped.extend(self._report_skipped(first[0].skipped))
        warm = bool(first and first[0].warm_start)
        step = int(first[0].step) if first else self.last_good.step if self.last_good else -1
        def restore(client):
            try:
                if warm:
                    return client.restore(pb.RestoreRequest(path=path, run_id=run_id, warm_start=True), timeout)
                return client.restore(pb.RestoreRequest(path=self._path(client.pod_index, step, path),
                                                        run_id=run_id), timeout)
            except WorkerError as exc:
                if directory and exc.code == grpc.StatusCode.DATA_LOSS:   # CorruptCheckpoint: its part's arrays
                    return _PartUnreadable(step, client.pod_index, str(exc))
                raise
        replies = first + parallel(restore, clients[len(first):])
        unreadable = [r for r in replies if isinstance(r, _PartUnreadable)]
        if unreadable:
            raise unreadable[0]
        if len({r.fingerprint for r in replies}) > 1:
            raise RunError(f"pods restored {path} to different states: " +
                           ", ".join(f"{c.name}: {r.fingerprint}" for c, r in zip(clients, replies)))
        return replies, path

    def _report_skipped(self, skipped) -> list[dict]:
        """Say which newer checkpoints a resume passed over, and why (RestoreReply.skipped, whose
        problems name each part by the directory this controller sent); the same as records for
        the `restored` event ({"step", "parts": {pod: why}})."""
        pods = {self._directory(k): k for k in range(self.cluster.size)} if self.per_pod else \
            {self.directory: self.cluster.live[0]}
        records = []
        for checkpoint in skipped:
            parts = {str(pods.get(p.directory, p.directory)): _PART_STATES.get(p.state, "not whole")
                     for p in checkpoint.problems}
            whose = "pod {}'s part" if self.per_pod else "the checkpoint of pod {}"
            out(f"resume: skipping the checkpoint of step {checkpoint.step}, it is not whole: " +
                "; ".join(f"{whose.format(pod)} is {why}" for pod, why in parts.items()))
            records.append({"step": int(checkpoint.step), "parts": parts})
        return records


# What RestoreReply.skipped's PartState means, in the words the controller reports it with.
_PART_STATES = {pb.PART_STATE_MISSING: "missing", pb.PART_STATE_UNFINISHED: "unfinished",
                pb.PART_STATE_UNREADABLE: "unreadable", pb.PART_STATE_CORRUPT: "corrupt"}


class _PartUnreadable(Exception):
    """Pod `pod` could not read its part of the checkpoint of `step` (DATA_LOSS)."""

    def __init__(self, step: int, pod: int, error: str):
        super().__init__(error)
        self.step, self.pod, self.error = step, pod, error
