"""Checkpoints of one pod's state, written with orbax-checkpoint.

A checkpoint is `<root>/<step>/` holding the state (parameters, optimizer state, step) and a JSON
metadata item (fingerprint, data position, config, ...). Orbax writes into a temporary folder and
renames it only once every item is complete, so a failed or interrupted save never replaces the
last good checkpoint, and `latest()` only ever sees finished ones.

Saves are asynchronous: `Writer.submit` takes host copies of the state (the only part the step
loop has to wait for) and a background thread writes them; `Writer.wait` reports the outcome.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import pathlib
import threading

import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit this run; the message says which."""


def _manager(root: pathlib.Path, max_to_keep: int | None = None, create: bool = True) -> ocp.CheckpointManager:
    import jax
    # A host of a multi-host pod reads and writes host arrays on its own (host 0 writes, every
    # host reads): orbax must not wait at barriers for the pod's other processes.
    me = jax.process_index()
    multiprocessing = ocp.options.MultiprocessingOptions()
    if jax.process_count() > 1:
        multiprocessing = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        if create:      # orbax will not create the root itself with active_processes set
            root.mkdir(parents=True, exist_ok=True)
            create = False
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                           create=create, multiprocessing_options=multiprocessing)
    return ocp.CheckpointManager(root, options=options)


def save(directory: str, state: dict, fingerprint: str, metadata_json: str,
         max_to_keep: int | None = None) -> pathlib.Path:
    """Write `state` (host arrays) as checkpoint `<directory>/<step>`, keeping the newest
    `max_to_keep`; returns its path. Synchronous: Writer runs it in the background."""
    root = pathlib.Path(directory).absolute()
    meta = json.loads(metadata_json)
    meta["fingerprint"] = fingerprint
    meta["step"] = int(state["step"])
    manager = _manager(root, max_to_keep)
    try:
        manager.save(int(state["step"]), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        manager.wait_until_finished()
    finally:
        manager.close()
    return root / str(int(state["step"]))


def steps(directory: str) -> list[int]:
    """The finished checkpoints under `directory`, oldest first (empty if there are none)."""
    root = pathlib.Path(directory).absolute()
    if not root.is_dir():
        return []
    manager = _manager(root, create=False)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def latest(directory: str) -> pathlib.Path:
    """The newest finished checkpoint under `directory`; CheckpointError if there is none."""
    found = steps(directory)
    if not found:
        raise CheckpointError(f"no checkpoint to resume from in {pathlib.Path(directory).absolute()}")
    return pathlib.Path(directory).absolute() / str(found[-1])


def restore(path: str, template: dict) -> tuple[dict, dict]:
    """Read checkpoint `path` (= `<root>/<step>`) into the structure of `template`."""
    target = pathlib.Path(path).absolute()
    if not target.is_dir():
        raise CheckpointError(f"no checkpoint at {target}")
    try:
        step = int(target.name)
    except ValueError:
        raise CheckpointError(f"{target} is not a checkpoint folder (its name must be the step)") from None
    manager = _manager(target.parent, create=False)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
    except Exception as exc:
        others = [s for s in steps(str(target.parent)) if s != step]
        hint = f"; other checkpoints in {target.parent}: {', '.join(map(str, others))}" if others else ""
        raise CheckpointError(f"checkpoint {target} is corrupt or unreadable: {_short(exc)}{hint}") from None
    finally:
        manager.close()
    return restored["state"], restored["meta"]


def _short(exc: Exception, limit: int = 300) -> str:
    """The gist of a reader error (tensorstore appends kilobytes of spec JSON)."""
    text = f"{type(exc).__name__}: {exc}".split(" [tensorstore_spec")[0]
    return text if len(text) <= limit else text[:limit] + "..."


def read_metadata(path: str) -> dict:
    """Only the JSON metadata of checkpoint `path` (cheap: no arrays are read)."""
    target = pathlib.Path(path).absolute()
    if not target.is_dir():
        raise CheckpointError(f"no checkpoint at {target}")
    if not target.name.isdigit():
        raise CheckpointError(f"{target} is not a checkpoint folder (its name must be the step)")
    manager = _manager(target.parent, create=False)
    try:
        restored = manager.restore(int(target.name), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {target}: metadata is corrupt or unreadable: {_short(exc)}") from None
    finally:
        manager.close()
    meta = restored["meta"]
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {target}: metadata is not a JSON object")
    return meta


def check_compatible(path: str, metadata: dict, state_key: dict) -> None:
    """CheckpointError naming every value the checkpoint at `path` disagrees on, among those the
    pod's state depends on (WorkerConfig.state_key: model, optimizer, schedule, seed, batch shape)."""
    saved = metadata.get("state_key")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} has no state key in its metadata; it was not written by "
                              f"this version of multipod")
    have, want = _flatten("", saved), _flatten("", state_key)
    missing = "<missing>"
    differences = [f"{name}: checkpoint has {have.get(name, missing)!r}, this run has {want.get(name, missing)!r}"
                   for name in sorted(set(have) | set(want)) if have.get(name, missing) != want.get(name, missing)]
    if differences:
        raise CheckpointError(f"checkpoint {path} does not fit this run: " + "; ".join(differences))


def _flatten(prefix: str, value) -> dict:
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            out.update(_flatten(f"{prefix}.{key}" if prefix else key, inner))
        return out
    return {prefix: value}


class Writer:
    """Writes checkpoints on one background thread, in submission order, and remembers each
    save's outcome so the controller can ask for it (Save with wait=True)."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._futures: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def submit(self, directory: str, state: dict, fingerprint: str, metadata_json: str,
               max_to_keep: int | None) -> pathlib.Path:
        """Start writing `state` (already host copies, so the pod may step on); returns the path
        it will have."""
        root = str(pathlib.Path(directory).absolute())
        step = int(state["step"])
        future = self._pool.submit(save, root, state, fingerprint, metadata_json, max_to_keep)
        future.add_done_callback(lambda f: f.exception() and log.error(
            "checkpoint of step %d in %s FAILED: %s", step, root, f.exception()))
        with self._lock:
            self._futures[(root, step)] = future
            if len(self._futures) > 64:   # outcomes nobody asked for: keep memory bounded
                for key in list(self._futures)[:-64]:
                    if self._futures[key].done():
                        del self._futures[key]
        return pathlib.Path(root) / str(step)

    def wait(self, directory: str, step: int, timeout_s: float) -> pathlib.Path:
        """The path of the finished save of `step`; CheckpointError if it failed, TimeoutError if
        it is still being written after timeout_s, KeyError if no such save was submitted."""
        root = str(pathlib.Path(directory).absolute())
        with self._lock:
            future = self._futures.get((root, step))
        if future is None:
            raise KeyError(f"no checkpoint of step {step} in {root} was started on this pod")
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"checkpoint of step {step} still being written after {timeout_s:g}s") from None
        except Exception as exc:
            raise CheckpointError(f"checkpoint of step {step} in {root} failed: {_short(exc)}; "
                                  f"the previous checkpoints are untouched") from None

    def close(self, timeout_s: float = 60.0) -> None:
        """Let pending writes finish (bounded), then stop the thread."""
        with self._lock:
            pending = [f for f in self._futures.values() if not f.done()]
        concurrent.futures.wait(pending, timeout=timeout_s)
        self._pool.shutdown(wait=False)
