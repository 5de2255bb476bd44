"""A pod's background checkpoint saves (the `Writer`), on checkpoint.py's orbax managers: one
asynchronous manager per checkpoint root, each save's outcome kept for the controller's WaitSave,
and a failed save reported, never committed over the last good checkpoint (checkpoint.py's
docstring says how orbax makes that so)."""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
from typing import TYPE_CHECKING

from multipod.pod_worker.checkpoint import CheckpointError, save_args, short_error, writing_manager

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

_POLL_S = 0.02


def _reread_if_changed(manager: ocp.CheckpointManager, root: pathlib.Path) -> None:
    """Have `manager` read the checkpoints under `root` again if they are not the ones it knows:
    in DiLoCo mode a survivor writes a failed pod's part into that pod's directory, and the pod
    (back again) writes there after it, each with its own manager; one that kept a stale list
    would try to delete folders the other already deleted and keep more than `keep` (measured:
    three of keep 2, orbax warning "Unable to find the step"). No save is in flight under `root`
    here (Writer.submit settled it)."""
    on_disk = {int(p.name) for p in root.iterdir() if p.name.isdigit()} if root.is_dir() else set()
    if on_disk != set(manager.all_steps()):
        manager.reload()


@dataclasses.dataclass
class _Outcome:
    """One save: pending until settled, then done (error None) or failed."""
    path: pathlib.Path
    settled: bool = False
    error: str | None = None


class Writer:
    """The pod's checkpoint saves, through one asynchronous orbax CheckpointManager per checkpoint
    root (orbax writes one save at a time per manager, in its own background thread), and each
    save's outcome so the controller can ask for it (WaitSave). Thread-safe."""

    MAX_MANAGERS = 8     # roots kept open; the least recently used idle one is closed beyond that

    def __init__(self) -> None:
        self._lock = threading.RLock()      # held for orbax calls that do not wait for a write
        self._managers: dict[str, tuple[ocp.CheckpointManager, int | None]] = {}
        self._pending: dict[str, int] = {}  # root -> the step orbax is writing there (unsettled)
        self._outcomes: dict[tuple[str, int], _Outcome] = {}

    @staticmethod
    def _root(directory: str) -> str:
        return str(pathlib.Path(directory).absolute())

    def _settle(self, root: str, block: bool) -> bool:
        """Record the outcome of the save in flight under `root` once orbax has finished it (with
        block, wait for that); True if nothing is in flight any more. Called with the lock held."""
        step = self._pending.get(root)
        if step is None:
            return True
        manager, _ = self._managers[root]
        if not block and manager.is_saving_in_progress():
            return False
        outcome = self._outcomes[(root, step)]
        try:
            # Raises the background write's error (once per calling thread: the outcome keeps it).
            manager.wait_until_finished()
            if not (pathlib.Path(root) / str(step)).is_dir():
                raise CheckpointError("orbax finished without committing the checkpoint folder")
        except Exception as exc:   # noqa: BLE001 - whatever the write raised is the outcome
            outcome.error = short_error(exc)
            log.error("checkpoint of step %d in %s FAILED: %s", step, root, outcome.error)
            # orbax would raise this error again in the next save called from another thread: the
            # next save under this root starts with a fresh manager (which reads the steps anew).
            self._drop(root)
        outcome.settled = True
        del self._pending[root]
        return True

    def _drop(self, root: str) -> None:
        manager, _ = self._managers.pop(root)
        try:
            manager.close()
        except Exception as exc:   # noqa: BLE001 - the failed save's error, raised once more
            log.debug("closing the checkpoint manager of %s: %s", root, short_error(exc))

    def _manager(self, root: str, max_to_keep: int | None) -> ocp.CheckpointManager:
        """The manager for `root` with `max_to_keep` (a different keep count: a new manager)."""
        found = self._managers.get(root)
        if found is not None and found[1] == max_to_keep:
            self._managers[root] = self._managers.pop(root)      # most recently used last
            return found[0]
        if found is not None:
            self._settle(root, block=True)
            found[0].close()
            del self._managers[root]
        for other in list(self._managers):
            if len(self._managers) < self.MAX_MANAGERS:
                break
            if self._settle(other, block=False):
                self._managers.pop(other)[0].close()
        manager = writing_manager(pathlib.Path(root), max_to_keep)
        self._managers[root] = (manager, max_to_keep)
        return manager

    def wait_idle(self, directory: str, timeout_s: float) -> None:
        """Wait (at most timeout_s) until no earlier save is being written under `directory`: orbax
        writes one at a time, and the next save would wait for it. TimeoutError if it still is."""
        root = self._root(directory)
        deadline = time.monotonic() + max(0.0, timeout_s)
        step: int | str
        while True:
            if self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    if self._settle(root, block=False):
                        return
                    step = self._pending[root]
                finally:
                    self._lock.release()
            else:
                step = self._pending.get(root, "?")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the checkpoint of step {step} in {root} is still being written")
            time.sleep(_POLL_S)

    def submit(self, directory: str, state: dict, fingerprint: str, metadata_json: str,
               max_to_keep: int | None) -> pathlib.Path:
        """Start writing `state` (the pod's device arrays: orbax has copied this host's shards to
        the host when this returns, so the pod may step on and donate them); returns the path it
        will have. A failure to start is recorded as the save's outcome (Writer.wait reports it)."""
        root = self._root(directory)
        step = int(state["step"])
        path = pathlib.Path(root) / str(step)
        with self._lock:
            outcome = self._outcomes[(root, step)] = _Outcome(path)
            if len(self._outcomes) > 64:   # outcomes nobody asked for: keep memory bounded
                for key in list(self._outcomes)[:-64]:
                    if self._outcomes[key].settled:
                        del self._outcomes[key]
            try:
                manager = self._manager(root, max_to_keep)
                # The previous save first: its outcome is recorded here, in this thread, so orbax's
                # own wait for it inside save() does not raise its error again.
                self._settle(root, block=True)
                _reread_if_changed(manager, pathlib.Path(root))
                if step in manager.all_steps():
                    # A run saves a step once per timeline: one already here is of a timeline the run
                    # left (a --resume that skipped a checkpoint not every part of which was written,
                    # a rewind), and the newest save wins. Left there, orbax would refuse this save
                    # (StepAlreadyExistsError) and a later --resume could take the abandoned state.
                    log.warning("checkpoint of step %d in %s replaces the one of an earlier timeline", step, root)
                    manager.delete(step)
                manager.save(step, args=save_args(state, fingerprint, metadata_json), force=True)
            except Exception as exc:   # noqa: BLE001 - reported through wait()
                outcome.error, outcome.settled = short_error(exc), True
                log.error("checkpoint of step %d in %s FAILED to start: %s", step, root, outcome.error)
                return path
            self._pending[root] = step
        return path

    def wait(self, directory: str, step: int, timeout_s: float) -> pathlib.Path:
        """The path of the finished save of `step`; CheckpointError if it failed, TimeoutError if
        it is still being written after timeout_s, KeyError if no such save was submitted."""
        root = self._root(directory)
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            outcome = self._outcomes.get((root, int(step)))
        if outcome is None:
            raise KeyError(f"no checkpoint of step {step} in {root} was started on this pod")
        while not outcome.settled:
            if self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    if self._pending.get(root) == int(step):
                        self._settle(root, block=False)
                finally:
                    self._lock.release()
            if outcome.settled:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"checkpoint of step {step} still being written after {timeout_s:g}s")
            time.sleep(_POLL_S)
        if outcome.error is not None:
            raise CheckpointError(f"checkpoint of step {step} in {root} failed: {outcome.error}; "
                                  f"the previous checkpoints are untouched")
        return outcome.path

    def close(self, timeout_s: float = 60.0) -> None:
        """Let pending writes finish (bounded), then close the managers that are done."""
        deadline = time.monotonic() + timeout_s
        for root in list(self._managers):
            try:
                self.wait_idle(root, deadline - time.monotonic())
            except TimeoutError as exc:
                log.warning("closing with a checkpoint still being written: %s", exc)
                continue
            with self._lock:
                found = self._managers.pop(root, None)
                if found is not None:
                    found[0].close()
