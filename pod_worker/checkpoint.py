"""Checkpoints of one pod's state, written with orbax-checkpoint.

A checkpoint is `<root>/<step>/` holding the state (parameters, optimizer state, step) and a JSON
metadata item (fingerprint, data position, config, ...). Orbax writes into a temporary folder and
renames it when complete, so a failed save never replaces the last good checkpoint.
"""
from __future__ import annotations

import json
import pathlib

import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit this run."""


def _manager(root: pathlib.Path, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                           create=True)
    return ocp.CheckpointManager(root, options=options)


def save(directory: str, state: dict, fingerprint: str, metadata_json: str, max_to_keep: int | None = None) -> pathlib.Path:
    """Write `state` (host arrays) as checkpoint `<directory>/<step>`; returns its path."""
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


def restore(path: str, template: dict) -> tuple[dict, dict]:
    """Read checkpoint `path` (= `<root>/<step>`) into the structure of `template`."""
    target = pathlib.Path(path).absolute()
    if not target.is_dir():
        raise CheckpointError(f"no checkpoint at {target}")
    try:
        step = int(target.name)
    except ValueError:
        raise CheckpointError(f"{target} is not a checkpoint folder (its name must be the step)") from None
    manager = _manager(target.parent)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {target} cannot be read: {type(exc).__name__}: {exc}") from None
    finally:
        manager.close()
    return restored["state"], restored["meta"]
