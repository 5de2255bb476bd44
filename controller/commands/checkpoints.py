"""What `--checkpoint` names, for `multipod generate` and `multipod ptune`: a run's checkpoint
directory, one of its step folders or the run directory, and in a DiLoCo run a pod's part of
its checkpoints (pod-N/<step>); and the error for one that cannot be used."""
from __future__ import annotations

import dataclasses
import pathlib

from multipod.controller.core.errors import RunError


class GenerateError(RunError):
    """A checkpoint, config, tokenizer or prompt file that cannot be used; the message names it."""


@dataclasses.dataclass
class Checkpoint:
    """What --checkpoint names: the directory holding the run's files, the step folder to
    restore (None: the newest), and the folder of its step folders: `root`, or in a DiLoCo run
    pod 0's part of every checkpoint, `root/pod-0` (each pod writes its own part; the agreed
    parameters, which generation and prompt tuning use, are the same in every part)."""
    root: pathlib.Path
    path: pathlib.Path | None
    steps: pathlib.Path

    @property
    def is_part(self) -> bool:
        """Whether the step folders are a DiLoCo pod's parts (else an every-step run's checkpoints)."""
        return _is_pod_part(self.steps)


def _step_folders(directory: pathlib.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def _is_pod_part(path: pathlib.Path) -> bool:
    """Whether `path` is a DiLoCo pod's folder of checkpoint parts (checkpointer.pod_directory)."""
    from multipod.controller.components.checkpointer import pod_directory
    return path.name.startswith("pod-") and path.name[4:].isdigit() and \
        path == pathlib.Path(pod_directory(str(path.parent), int(path.name[4:])))


def _steps_of(root: pathlib.Path) -> pathlib.Path:
    """Where a checkpoint directory's newest step folders are: in it, or in a DiLoCo run in pod
    0's part. A DiLoCo run warm-started from an every-step run in the same directory has both;
    its parts then hold the newer steps (the first of them at the step it started from)."""
    from multipod.controller.components.checkpointer import pod_directory
    pod = pathlib.Path(pod_directory(str(root), 0))
    own, parts = _step_folders(root), _step_folders(pod)
    if parts and (not own or parts[-1] >= own[-1]):
        return pod
    return root


def saved_steps(directory: pathlib.Path) -> list[int]:
    """The steps a checkpoint directory holds checkpoints of: its step folders and, in a DiLoCo
    run, those of its pods' parts (pod-N/<step>)."""
    from multipod.controller.components.checkpointer import pod_directory
    steps = set(_step_folders(directory))
    if directory.is_dir():
        for part in directory.iterdir():
            if part.name.startswith("pod-") and part.name[4:].isdigit() and \
                    part == pathlib.Path(pod_directory(str(directory), int(part.name[4:]))):
                steps.update(_step_folders(part))
    return sorted(steps)


def newest_step(checkpoint: Checkpoint) -> pathlib.Path:
    """The newest step folder of a checkpoint (find_checkpoint made sure there is one)."""
    return checkpoint.steps / str(_step_folders(checkpoint.steps)[-1])


def find_checkpoint(text: str) -> Checkpoint:
    """The checkpoint --checkpoint names; GenerateError saying what is missing."""
    from multipod.controller.data.corpus import RUN_CONFIG
    path = pathlib.Path(text).expanduser().absolute()
    if not path.exists():
        raise GenerateError(f"checkpoint {text} does not exist")
    if not path.is_dir():
        raise GenerateError(f"checkpoint {text} is not a directory: give a run's checkpoint directory "
                            f"(RUN_DIR/checkpoints) or one of its step folders")
    if (path / RUN_CONFIG).is_file():
        steps = _steps_of(path)
        if not _step_folders(steps):
            raise GenerateError(f"checkpoint directory {text} holds no checkpoint yet (no step folder beside "
                                f"its {RUN_CONFIG}, nor in a DiLoCo run's pod-0 folder)")
        return Checkpoint(path, None, steps)
    if path.name.isdigit() and (path.parent / RUN_CONFIG).is_file():
        return Checkpoint(path.parent, path, path.parent)
    # A DiLoCo run's checkpoints: a pod's folder of parts, or one of its step folders.
    if _is_pod_part(path) and (path.parent / RUN_CONFIG).is_file():
        if not _step_folders(path):
            raise GenerateError(f"checkpoint directory {text} holds no checkpoint yet (no step folder in it)")
        return Checkpoint(path.parent, None, path)
    if path.name.isdigit() and _is_pod_part(path.parent) and (path.parent.parent / RUN_CONFIG).is_file():
        return Checkpoint(path.parent.parent, path, path.parent)
    if (path / "checkpoints" / RUN_CONFIG).is_file():     # a run directory with its default checkpoint folder
        return find_checkpoint(str(path / "checkpoints"))
    if path.name.isdigit() or _step_folders(path):
        where = path.parent if path.name.isdigit() else path
        raise GenerateError(f"checkpoint {text}: no {RUN_CONFIG} in {where}: the run's config is written beside "
                            f"its checkpoints (by runs of this version), and generation needs it")
    raise GenerateError(f"{text} is not a checkpoint: it holds neither step folders nor {RUN_CONFIG}")
