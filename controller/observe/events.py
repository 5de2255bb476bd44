"""events.jsonl: one JSON line per run event (checkpoints, failures, restarts, rewinds)."""
from __future__ import annotations

import json
import pathlib
import time


class EventLog:
    """Appends events to a file, flushed at once so that a crash loses none."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._file = path.open("a")

    def write(self, kind: str, **fields) -> None:
        """One line: {"event": kind, "time": ..., **fields}."""
        self._file.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
