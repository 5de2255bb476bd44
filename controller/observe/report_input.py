"""The run directory's files as `multipod report` reads them: metrics.jsonl's step and evaluation
records and events.jsonl's events, each bad line a ReportError naming the file and the line."""
from __future__ import annotations

import json
import logging
import pathlib

from multipod.controller.observe.events import KINDS, Event
from multipod.controller.observe.records import StepRecord

log = logging.getLogger(__name__)


class ReportError(ValueError):
    """A run directory the report cannot be drawn from (the message names the file)."""


def read_jsonl(path: pathlib.Path, required: bool) -> list[dict]:
    """The JSON objects of a .jsonl file, one per non-blank line. ReportError, naming the file
    (and the line), if it is missing (when required), empty (when required) or malformed; a
    torn last line (no newline) is left out with a warning."""
    return [value for _, value in _numbered(path, required)]


def _numbered(path: pathlib.Path, required: bool) -> list[tuple[int, dict]]:
    """read_jsonl's objects with their line numbers."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise ReportError(f"{path}: no such file (is this a run directory?)") from None
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot be read: {exc}") from None
    lines = []
    numbered = list(enumerate(text.splitlines(), start=1))
    for number, line in numbered:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            if number == len(numbered) and not text.endswith("\n"):
                # A last line without its newline: a write cut short (a full disk, a crash), or
                # one being written now. The lines before it are whole; the next run cuts it off.
                log.warning("%s, line %d: cut short (%s), left out", path, number, exc)
                continue
            raise ReportError(f"{path}, line {number}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ReportError(f"{path}, line {number}: expected a JSON object, got {type(value).__name__}")
        lines.append((number, value))
    if required and not lines:
        raise ReportError(f"{path}: empty: the run wrote no step yet")
    return lines


def read_metrics(path: pathlib.Path) -> tuple[list[StepRecord], list[dict]]:
    """metrics.jsonl's step records (the lines with a "loss", read as StepRecord) and evaluation
    records (those with an "eval_loss"), each in file order. ReportError naming the file and the
    line if the file cannot be read (read_jsonl), or a line has no integer step or is not a valid
    step record."""
    records, evals = [], []
    for number, value in _numbered(path, required=True):
        if not is_int(value.get("step")):
            raise ReportError(f"{path}, line {number}: no integer \"step\"")
        if "eval_loss" in value:
            evals.append(value)
        elif "loss" in value:
            try:
                records.append(StepRecord.from_json(value))
            except ValueError as exc:
                raise ReportError(f"{path}, line {number}: not a step record: {exc}") from None
    return records, evals


def read_events(path: pathlib.Path) -> list[Event]:
    """events.jsonl's events, in file order (none if there is no file); kinds this version does
    not know are left out. ReportError naming the file and the line if one is malformed."""
    events = []
    for number, value in _numbered(path, required=False):
        if value.get("event") not in KINDS:
            continue
        try:
            events.append(Event.from_json(value))
        except ValueError as exc:
            raise ReportError(f"{path}, line {number}: {exc}") from None
    return events


def is_int(value) -> bool:
    """Whether a JSON value is an integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)
