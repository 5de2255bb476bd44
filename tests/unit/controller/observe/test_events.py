"""events.jsonl: an Event per line, its kind an EventKind, written and read back."""
from __future__ import annotations

import json

import pytest

from multipod.controller.observe.events import Event, EventKind, EventLog


def test_events_are_written_one_per_line_and_read_back(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    log.write(EventKind.CHECKPOINT_SAVED, step=3, path="ckpt/3")
    log.write(EventKind.POD_FAILURE, error="pod 1 died", pods=[1])
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["event"] == "checkpoint_saved" and first["step"] == 3 and isinstance(first["time"], float)
    events = [Event.from_json(line) for line in lines]
    assert [e.kind for e in events] == [EventKind.CHECKPOINT_SAVED, EventKind.POD_FAILURE]
    assert events[0].get("path") == "ckpt/3" and events[1].get("pods") == [1] and events[1].get("step") is None
    assert Event.from_json(events[1].to_json()) == events[1]


@pytest.mark.parametrize("line, message", [
    ('{"event": "lunch", "time": 1.0}', "'lunch' is not one of checkpoint_started"),
    ('{"time": 1.0}', "None is not one of"),
    ('{"event": "rejoin", "time": "noon"}', "event 'rejoin' has no number \"time\""),
    ('[1]', "must be a JSON object"),
])
def test_a_malformed_event_is_refused_saying_why(line, message):
    with pytest.raises(ValueError, match=message):
        Event.from_json(line)


def test_the_log_refuses_a_kind_it_does_not_know(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="lunch"):
        log.write("lunch", step=1)
    log.close()
    assert (tmp_path / "events.jsonl").read_text() == ""


@pytest.mark.parametrize("before, after", [
    ("", ""),                                               # a new file
    ('{"a": 1}\n{"b": 2}\n', '{"a": 1}\n{"b": 2}\n'),       # whole lines: kept as they are
    ('{"a": 1}\n{"b": ', '{"a": 1}\n'),                     # a torn last line: cut off
    ('{"b": ', ""),                                         # nothing whole at all
    ('{"a": 1}\n' + "x" * 200_000, '{"a": 1}\n'),           # a torn line longer than one block read
])
def test_appending_cuts_a_torn_last_line_so_the_next_line_starts_its_own(tmp_path, before, after):
    path = tmp_path / "events.jsonl"
    if before:
        path.write_text(before)
    log = EventLog(path)
    log.write(EventKind.CHECKPOINT_SAVED, step=3, path="ckpt/3")
    log.close()
    text = path.read_text()
    assert text.startswith(after)
    assert Event.from_json(text[len(after):].rstrip("\n")).get("step") == 3
