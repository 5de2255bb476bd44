"""Checkpoints of one pod's state, written with orbax-checkpoint.

A checkpoint is `<root>/<step>/` holding the state (parameters, optimizer state, step) and a JSON
metadata item (fingerprint, data position, config, ...). Orbax writes into a temporary folder and
renames it only once every item is complete, so a failed or interrupted save never replaces the
last good checkpoint, and `latest()` only ever sees finished ones.

Saves are orbax's own asynchronous checkpointing, straight from the sharded device arrays, through
checkpoint_writer.py's `Writer` (this module's `save` is the synchronous one): `Writer.submit`
returns once orbax has its host copy of this host's shards (the only part the step loop waits
for; the update may then donate the arrays), and orbax writes them in its own background thread;
`Writer.wait` reports the outcome. With several hosts per pod every host of the pod calls the
same save: each writes the shards it owns (a replicated array is written once,
its replicas' work split between the hosts), orbax's barriers meet over the pod's jax.distributed
client, and the primary host writes the JSON metadata and commits the folder.

Reads are per host (no barrier): every host restores the shards its devices need, with the
shardings of ITS trainer, so a checkpoint restores onto another device count per pod when the
shapes agree (orbax reshards); a leaf whose shape or dtype differs is named in a CheckpointError.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pathlib
from typing import TYPE_CHECKING

from multipod.pod_worker.schema.training import LrSchedule, wsd_decay_start

log = logging.getLogger(__name__)

# Orbax splits the write of a replicated array between its replicas (replica-parallel saving).
# Across the hosts of a pod that spreads the writing itself, and orbax's default is kept. Within one
# process the same process writes every part, and the split only spreads the device-to-host copies
# over its devices, at the price of a compiled slice program per shape and device at the first save
# (with the step loop waiting; docs/benchmarks.md, "Two fewer kinds of program") and a dispatch per
# part at every save. A single-process pod splits only the
# arrays whose parts are at least this large, where the copies are worth spreading.
MIN_REPLICA_PARALLEL_SLICE_BYTES = 1 << 20


def _import_orbax():
    """orbax.checkpoint, its jax.Array handler set up as above for a single-process pod. Once per
    process, after jax.distributed has started (a worker's first save or restore)."""
    import jax
    import orbax.checkpoint
    from orbax.checkpoint import type_handlers

    if jax.process_count() > 1:
        return orbax.checkpoint
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)   # orbax warns at every override, even a deliberate one
    try:
        handler = type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_PARALLEL_SLICE_BYTES)
        type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_log.setLevel(level)
    return orbax.checkpoint


if TYPE_CHECKING:
    import orbax.checkpoint as ocp
else:
    class _Orbax:
        """orbax.checkpoint, imported at its first use: about 0.3 s of CPU that a worker which never
        saves or restores (every pod but the writer, in most runs) does not spend at start."""

        _module = None

        def __getattr__(self, name: str):
            if _Orbax._module is None:
                _Orbax._module = _import_orbax()
            return getattr(_Orbax._module, name)

    ocp = _Orbax()

# A background write (and its barriers between the pod's hosts) that takes longer fails.
WRITE_TIMEOUT_S = 1200


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit this run; the message says which."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose arrays or metadata cannot be read back (corrupt), as opposed to one that
    is missing or does not fit."""


def _handlers() -> dict:
    return {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}


def writing_manager(root: pathlib.Path, max_to_keep: int | None) -> ocp.CheckpointManager:
    """An asynchronous manager every host of the pod uses alike (one per host, same calls)."""
    import jax
    multiprocessing = ocp.options.MultiprocessingOptions()
    create = True
    if jax.process_count() > 1:
        # Every process of the pod's cluster takes part. Naming them makes orbax meet at the
        # jax.distributed client's barriers rather than in a device collective (a gloo
        # collective from orbax's thread could interleave with a step's own). The prefix keeps
        # the barriers of two roots apart.
        prefix = "multipod-" + hashlib.blake2b(str(root).encode(), digest_size=6).hexdigest()
        multiprocessing = ocp.options.MultiprocessingOptions(
            primary_host=0, active_processes=set(range(jax.process_count())), barrier_sync_key_prefix=prefix)
        root.mkdir(parents=True, exist_ok=True)   # orbax will not with active_processes set
        create = False
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=True, create=create,
        multiprocessing_options=multiprocessing, async_options=ocp.AsyncOptions(timeout_secs=WRITE_TIMEOUT_S))
    return ocp.CheckpointManager(root, options=options, item_handlers=_handlers())


def _reading_manager(root: pathlib.Path) -> ocp.CheckpointManager:
    """A manager that only reads, on this host alone: no barriers with the pod's other hosts."""
    import jax
    me = jax.process_index()
    multiprocessing = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    options = ocp.CheckpointManagerOptions(create=False, multiprocessing_options=multiprocessing)
    return ocp.CheckpointManager(root, options=options, item_handlers=_handlers())


def save_args(state: dict, fingerprint: str, metadata_json: str) -> ocp.args.Composite:
    meta = json.loads(metadata_json)
    meta["fingerprint"] = fingerprint
    meta["step"] = int(state["step"])
    return ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))


def save(directory: str, state: dict, fingerprint: str, metadata_json: str,
         max_to_keep: int | None = None) -> pathlib.Path:
    """Write `state` (device or host arrays) as checkpoint `<directory>/<step>`, keeping the
    newest `max_to_keep`, and wait until it is complete; returns its path. Every host of a pod
    must call it alike. The pod's saves go through checkpoint_writer.Writer instead (background)."""
    root = pathlib.Path(directory).absolute()
    step = int(state["step"])
    manager = writing_manager(root, max_to_keep)
    try:
        manager.save(step, args=save_args(state, fingerprint, metadata_json), force=True)
        manager.wait_until_finished()
    finally:
        manager.close()
    return root / str(step)


def steps(directory: str) -> list[int]:
    """The finished checkpoints under `directory`, oldest first (empty if there are none)."""
    root = pathlib.Path(directory).absolute()
    if not root.is_dir():
        return []
    manager = _reading_manager(root)
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


def _checkpoint_path(path: str) -> tuple[pathlib.Path, int]:
    target = pathlib.Path(path).absolute()
    if not target.is_dir():
        raise CheckpointError(f"no checkpoint at {target}")
    if not target.name.isdigit():
        raise CheckpointError(f"{target} is not a checkpoint folder (its name must be the step)")
    return target, int(target.name)


def abstract(tree):
    """The restore target of a tree of arrays: each jax.Array becomes a jax.ShapeDtypeStruct
    with its sharding (orbax reads only the shards this host's devices need, laid out that way);
    other leaves (host arrays, the step) stay as they are."""
    import jax
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def _leaf_name(path) -> tuple[str, ...]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return tuple(names)


def _check_fits(target: pathlib.Path, saved, template) -> None:
    """CheckpointError naming every leaf whose shape or dtype (or presence) differs between the
    checkpoint's array metadata and `template`."""
    import jax
    import numpy as np
    have = {_leaf_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
    want = {_leaf_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(template)[0]}
    problems = []
    for name in sorted(set(have) | set(want), key=lambda n: (n[:1] != ("params",), n)):   # params first
        label = ".".join(name)
        if name not in have:
            problems.append(f"{label}: missing in the checkpoint")
        elif name not in want:
            problems.append(f"{label}: in the checkpoint, not in this pod's state")
        else:
            a, b = have[name], want[name]
            a_shape, b_shape = tuple(getattr(a, "shape", ())), tuple(np.shape(b))
            a_dtype, b_dtype = getattr(a, "dtype", None), getattr(b, "dtype", None)
            if a_shape != b_shape:
                problems.append(f"{label}: checkpoint has shape {a_shape}, this pod has {b_shape}")
            elif b_shape and a_dtype is not None and b_dtype is not None and np.dtype(a_dtype) != np.dtype(b_dtype):
                problems.append(f"{label}: checkpoint has dtype {np.dtype(a_dtype)}, this pod has {np.dtype(b_dtype)}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"checkpoint {target} does not fit this pod's state: {shown}")


def restore(path: str, template: dict) -> tuple[dict, dict]:
    """Read checkpoint `path` (= `<root>/<step>`) into the structure of `template`: jax.Array or
    jax.ShapeDtypeStruct leaves come back as jax.Arrays with the template's shardings (only this
    host's shards are read; the layout may differ from the one saved), host arrays as host arrays.
    CheckpointError naming the leaf if a shape or dtype differs, or if the checkpoint is corrupt."""
    target, step = _checkpoint_path(path)
    template = abstract(template)
    manager = _reading_manager(target.parent)
    try:
        try:
            saved = manager.item_metadata(step)["state"]
        except Exception as exc:
            raise _corrupt(target, exc) from None
        if saved is not None:
            _check_fits(target, saved, template)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
        except Exception as exc:
            raise _corrupt(target, exc) from None
    finally:
        manager.close()
    return restored["state"], restored["meta"]


def _corrupt(target: pathlib.Path, exc: BaseException) -> UnreadableCheckpoint:
    others = [s for s in steps(str(target.parent)) if s != int(target.name)]
    hint = f"; other checkpoints in {target.parent}: {', '.join(map(str, others))}" if others else ""
    return UnreadableCheckpoint(f"checkpoint {target} is corrupt or unreadable: {short_error(exc)}{hint}")


def short_error(exc: BaseException, limit: int = 300) -> str:
    """The gist of a reader error (tensorstore appends kilobytes of spec JSON)."""
    text = f"{type(exc).__name__}: {exc}".split(" [tensorstore_spec")[0]
    return text if len(text) <= limit else text[:limit] + "..."


def read_metadata(path: str) -> dict:
    """Only the JSON metadata of checkpoint `path` (cheap: no arrays are read)."""
    target, step = _checkpoint_path(path)
    manager = _reading_manager(target.parent)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as exc:
        raise UnreadableCheckpoint(
            f"checkpoint {target}: metadata is corrupt or unreadable: {short_error(exc)}") from None
    finally:
        manager.close()
    meta = restored["meta"]
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {target}: metadata is not a JSON object")
    return meta


# State-key entries that checkpoints of earlier versions hold and WorkerConfig.state_key no longer
# has (it says why): not compared, so those checkpoints still resume.
_RETIRED_KEYS = ("optimizer.decay_steps", "sync.replay_history_mb")
# What a user can do about a difference, where there is one thing to do.
_HINTS = {"schedule_steps": " (the steps the learning rate decays over: optimizer.decay_steps, else the run's "
                            "steps; to train on past the saved run's end, keep its schedule: --set "
                            "optimizer.decay_steps={saved})"}


def check_compatible(path: str, metadata: dict, state_key: dict) -> None:
    """CheckpointError naming every value the checkpoint at `path` disagrees on, among those the
    pod's state depends on (WorkerConfig.state_key: model, optimizer, schedule, seed, batch shape).

    A warmup-stable-decay schedule (optimizer.schedule = "wsd") on both sides may differ in its
    length and decay: the rates of the steps the checkpoint ran are this run's too as long as the
    checkpoint's step is in both schedules' stable phase (or warmup), so it resumes bitwise as a
    run of this schedule from the start. That is what wsd is for: a run extended, or a decay
    branched off, from a checkpoint of its stable phase."""
    saved = metadata.get("state_key")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} has no state key in its metadata; it was not written by "
                              f"this version of multipod")
    have = {name: value for name, value in _flatten("", saved).items() if name not in _RETIRED_KEYS}
    want = _flatten("", state_key)
    for key in (have, want):    # a key without a schedule is cosine's (and written before wsd existed)
        key.setdefault(_SCHEDULE, LrSchedule.COSINE.value)
    problems = []
    if have[_SCHEDULE] == want[_SCHEDULE] == LrSchedule.WSD.value:
        problems = _wsd_resume_problems(metadata, have, want)
        for key in (have, want):
            for name in _WSD_LENGTH:
                key.pop(name, None)
    missing = "<missing>"
    differences = [f"{name}: checkpoint has {have.get(name, missing)!r}, this run has {want.get(name, missing)!r}"
                   + _HINTS.get(name, "").format(saved=have.get(name, missing))
                   for name in sorted(set(have) | set(want)) if have.get(name, missing) != want.get(name, missing)]
    if differences or problems:
        raise CheckpointError(f"checkpoint {path} does not fit this run: " + "; ".join(differences + problems))


_SCHEDULE = "optimizer.schedule"
# What a wsd schedule's length and decay are made of: they may differ between the checkpoint and
# the run while its step is before both decays.
_WSD_LENGTH = ("schedule_steps", "optimizer.decay_fraction")


def _wsd_resume_problems(metadata: dict, have: dict, want: dict) -> list[str]:
    """Why a checkpoint of a wsd run cannot resume in this wsd run (empty if it can): its step must
    not be past the start of either schedule's decay."""
    if have[_WSD_LENGTH[0]] == want[_WSD_LENGTH[0]] and have[_WSD_LENGTH[1]] == want[_WSD_LENGTH[1]]:
        return []       # the same schedule: any step resumes
    step = metadata.get("step")
    try:
        starts = {side: wsd_decay_start(int(key["schedule_steps"]), float(key["optimizer.decay_fraction"]),
                                        int(key["optimizer.warmup_steps"])) for side, key in (("saved", have),
                                                                                               ("this", want))}
    except (KeyError, TypeError, ValueError):
        return ["its wsd schedule is not recorded whole (schedule_steps, optimizer.decay_fraction, "
                "optimizer.warmup_steps)"]
    if not isinstance(step, int):
        return ["it does not record its step, which a wsd schedule's resume needs"]
    problems = []
    if step > starts["saved"]:
        problems.append(f"step {step} is past the start of its own wsd decay (step {starts['saved']}): a run "
                        f"with another schedule length resumes only from a checkpoint of the stable phase")
    if step > starts["this"]:
        problems.append(f"this run's wsd decay starts at step {starts['this']}, before the checkpoint's step "
                        f"{step}: lengthen the run (--steps / optimizer.decay_steps) or lower "
                        f"optimizer.decay_fraction")
    return problems


def _flatten(prefix: str, value) -> dict:
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            out.update(_flatten(f"{prefix}.{key}" if prefix else key, inner))
        return out
    return {prefix: value}
