"""Which checkpoint a resume takes when a checkpoint is several parts (DiLoCo: one folder per pod,
`<checkpoint dir>/pod-<k>/<step>`): the newest step that every part holds whole.

A part is whole when orbax finished writing it (checkpoint.py: orbax writes into a temporary
folder `<step>.orbax-checkpoint-tmp-<n>` and renames it to `<step>` once every item is committed,
so `checkpoint.steps` lists only finished ones) and its metadata reads back as that step's. A part
whose write failed or was cut short (a pod's save failed, the controller died mid-save) leaves no
folder or only the temporary one; such a checkpoint is passed over, each part's problem recorded
as a PartState, so a failed save never costs the last good checkpoint."""
from __future__ import annotations

import dataclasses
import pathlib
import re

from multipod.pod_worker import checkpoint
from multipod.pod_worker.checkpoint import CheckpointError
from multipod.protos import multipod_pb2 as pb

# orbax's temporary folder of an unfinished write (orbax.checkpoint's TMP_DIR_SUFFIX, not public).
_UNFINISHED = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why one part of a checkpoint is not whole: `state` a pb.PartState, `detail` for people."""
    directory: str
    state: pb.PartState
    detail: str


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A checkpoint newer than the one chosen, passed over because of `problems`."""
    step: int
    problems: tuple[Problem, ...]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint to restore (`path`: the part under the first directory) and the newer ones skipped."""
    path: pathlib.Path
    step: int
    skipped: tuple[Skipped, ...]


def _unfinished(root: pathlib.Path) -> set[int]:
    """The steps under `root` that only have orbax's temporary folder (a write that never completed)."""
    if not root.is_dir():
        return set()
    found = (_UNFINISHED.match(p.name) for p in root.iterdir())
    return {int(m.group(1)) for m in found if m}


def _unreadable(root: pathlib.Path, step: int) -> str | None:
    """Why the finished part `<root>/<step>` cannot be read (its metadata), or None if it can."""
    try:
        meta = checkpoint.read_metadata(str(root / str(step)))
    except CheckpointError as exc:
        return str(exc)
    if meta.get("step") != step:
        return f"its metadata is of step {meta.get('step')!r}"
    return None


def holds_any(directories: list[str]) -> bool:
    """Whether any of `directories` holds a checkpoint, finished or not (a DiLoCo run that has
    saved at all: a warm start from an every-step run is only for one that has not)."""
    roots = [pathlib.Path(d).absolute() for d in directories]
    return any(checkpoint.steps(str(root)) or _unfinished(root) for root in roots)


def newest_finished(directories: list[str]) -> tuple[int, str] | None:
    """The newest finished checkpoint in any of `directories`: (its step, its directory as
    given), or None if they hold none."""
    found = [(max(steps), directory) for directory in directories
             if (steps := checkpoint.steps(str(pathlib.Path(directory).absolute())))]
    return max(found, key=lambda item: item[0]) if found else None


def newest_whole(directory: str, parts: list[str], before: int = 0) -> Choice:
    """The newest checkpoint of `directory` (older than `before`, if not 0) that every folder of
    `parts` also holds whole, and the newer steps any of them holds that were passed over (newest
    first, each with every part's problem). CheckpointError if no step is whole, naming why the
    newest ones are not."""
    names = [directory, *parts]     # a problem names a part as the request did
    roots = [pathlib.Path(d).absolute() for d in names]
    finished = [set(checkpoint.steps(str(root))) for root in roots]
    unfinished = [_unfinished(root) for root in roots]
    candidates = set().union(*finished, *unfinished)
    skipped: list[Skipped] = []
    for step in sorted((s for s in candidates if not before or s < before), reverse=True):
        problems = []
        for name, root, done, started in zip(names, roots, finished, unfinished):
            if step in done:
                why = _unreadable(root, step)
                if why is not None:
                    problems.append(Problem(name, pb.PART_STATE_UNREADABLE, why))
            elif step in started:
                problems.append(Problem(name, pb.PART_STATE_UNFINISHED,
                                        "only orbax's temporary folder: its write never completed"))
            else:
                problems.append(Problem(name, pb.PART_STATE_MISSING, "no folder of this step"))
        if not problems:
            return Choice(roots[0] / str(step), step, tuple(skipped))
        skipped.append(Skipped(step, tuple(problems)))
    where = str(roots[0]) + (f" (and its parts {', '.join(map(str, roots[1:]))})" if parts else "")
    older = f" older than step {before}" if before else ""
    if not skipped:
        raise CheckpointError(f"no checkpoint{older} to resume from in {where}")
    shown = "; ".join(f"step {s.step}: " + ", ".join(f"{p.directory} {pb.PartState.Name(p.state)}"
                                                      for p in s.problems) for s in skipped[:4])
    # Parts with no checkpoint at all beside parts with some: most likely a run of fewer pods
    # saved them (each pod writes and restores its own part).
    never = [name for name, done, started in zip(names, finished, unfinished) if not done and not started]
    hint = (f" ({', '.join(never)} hold no checkpoint at all: if a run of fewer pods saved these, resume it "
            f"with the number of pods that saved it, since each pod restores its own part)"
            if never and len(never) < len(names) else "")
    raise CheckpointError(f"no whole checkpoint{older} to resume from in {where}: {shown}{hint}")


def to_proto(skipped: tuple[Skipped, ...]) -> list[pb.SkippedCheckpoint]:
    """RestoreReply.skipped of a Choice."""
    return [pb.SkippedCheckpoint(step=s.step, problems=[pb.PartProblem(directory=p.directory, state=p.state,
                                                                       detail=p.detail) for p in s.problems])
            for s in skipped]
