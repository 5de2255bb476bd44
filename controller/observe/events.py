"""events.jsonl: one JSON line per run event (checkpoints, failures, restarts, rewinds), an Event.

A line is {"event": kind, "time": Unix seconds, **the kind's own fields}; EventKind lists the kinds
and the fields each carries."""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import IO, Any


class EventKind(enum.StrEnum):
    """What happened (a line's "event"), with the fields that kind carries."""
    CHECKPOINT_STARTED = "checkpoint_started"   # step, path: a save began (written in the background)
    CHECKPOINT_SAVED = "checkpoint_saved"       # step, path: that save is complete
    CHECKPOINT_FAILED = "checkpoint_failed"     # step, error: that save failed (the last good one stays)
    RESTORED = "restored"                       # step, path, data_offset, fingerprint: every pod restored it
    POD_FAILURE = "pod_failure"                 # error, pods (those named), mode (degrade only)
    RECOVERED = "recovered"                     # step, restarts: every pod is back, from a checkpoint
    REWIND = "rewind"                           # spike_step, loss, mean, to_step, data_offset: a loss spike
    DEGRADED = "degraded"                       # step, live_pods, hosts, failed: survivors take the shards
    STATE_TRANSFER = "state_transfer"           # donor, receiver, step, bytes, seconds, worker_seconds, fingerprint
    REJOIN = "rejoin"                           # step, pods, live_pods, hosts: failed pods are back
    REJOIN_FAILED = "rejoin_failed"             # pod, error, attempt (when retried)
    REATTACHED = "reattached"                   # step, data_offset, fingerprint: a new controller took live pods over
    SPARE_READY = "spare_ready"                 # spare (its hosts' addresses): a standby pod, checked, waits
    SPARE_REFUSED = "spare_refused"             # spare, error: a standby pod that cannot take a slot
    # step, slot, old_address, new_address, bytes, seconds (the state transfer), since_failure_s: a
    # spare took a failed pod's slot (hot-swap) and trains from `step` on
    HOT_SWAP = "hot_swap"
    # step, pods (outvoted), checksums ({pod: checksum}), majority (the checksum most pods hold),
    # leaf (null: the controller sees checksums only): pods whose state differs from a strict
    # majority's after `step` (silent corruption); they are taken out and rejoin from a majority peer
    OUTVOTED = "outvoted"
    # step, checksums, why: the pods' states differ and no majority tells which is right (two
    # pods): every pod goes back to the last checkpoint
    DIVERGED = "diverged"
    # step, sync, fragment, pods (averaged), dropped: a DiLoCo outer step averaged over the live
    # pods only (sync.on_pod_failure = "drop")
    OUTER_DROPPED = "outer_dropped"
    # slot, host, from_step, to_step, seconds, fingerprint: a DiLoCo survivor rebuilt a failed pod's
    # own state from its checkpoint part (sync.on_pod_failure = "replay") and trains it from to_step
    REPLAY = "replay"
    # step (the checkpoint's), steps ({pod: the step it stopped at}): DiLoCo survivors that stopped at
    # different steps (an outer exchange reached some of them) went back to the last checkpoint
    REALIGNED = "realigned"


@dataclasses.dataclass(frozen=True)
class Event:
    """One line of events.jsonl."""
    kind: EventKind
    time: float                                 # Unix time it was written
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # the kind's own (EventKind)

    def get(self, name: str, default: Any = None) -> Any:
        """One of the kind's fields, or `default`."""
        return self.fields.get(name, default)

    def to_json(self) -> str:
        """The line (without its newline)."""
        return json.dumps({"event": self.kind.value, "time": self.time, **self.fields})

    @classmethod
    def from_json(cls, line: str | Mapping[str, Any]) -> Event:
        """An event from a line (text, or the parsed object); ValueError saying what is wrong."""
        data = json.loads(line) if isinstance(line, str) else line
        if not isinstance(data, Mapping):
            raise ValueError(f"an event must be a JSON object, got {type(data).__name__}")
        name = data.get("event")
        if name not in KINDS:
            raise ValueError(f"event {name!r} is not one of {', '.join(KINDS)}")
        when = data.get("time")
        if isinstance(when, bool) or not isinstance(when, (int, float)):
            raise ValueError(f"event {name!r} has no number \"time\"")
        fields = {k: v for k, v in data.items() if k not in ("event", "time")}
        return cls(EventKind(name), float(when), fields)


KINDS = tuple(kind.value for kind in EventKind)


def open_appending(path: pathlib.Path) -> IO[str]:
    """`path` (a .jsonl file) opened to append lines, a torn last line cut off first: a write cut
    short (a full disk, the machine going down) leaves a line without its newline, and the next
    run's first line would be glued to it, one malformed line in the middle of the file."""
    try:
        with path.open("rb+") as f:
            end = f.seek(0, os.SEEK_END)
            keep = end
            while keep > 0:         # back to just after the last newline, a block at a time
                start = max(0, keep - (1 << 16))
                f.seek(start)
                block = f.read(keep - start)
                if keep == end and block.endswith(b"\n"):
                    break           # whole lines: nothing torn
                newline = block.rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                keep = start
            if keep < end:
                f.truncate(keep)
    except FileNotFoundError:
        pass
    return path.open("a")


class EventLog:
    """Appends events to a file, flushed at once so that a crash loses none."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._file = open_appending(path)

    def write(self, kind: EventKind, **fields: Any) -> None:
        """One line: Event(kind, now, fields)."""
        self._file.write(Event(EventKind(kind), time.time(), fields).to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
