"""`multipod report`: the series plotted from metrics.jsonl and events.jsonl, the PNG it writes,
and its errors."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import struct

import pytest

from multipod.cli import main
from multipod.controller.commands.train import write_report_quietly
from multipod.controller.observe.events import Event
from multipod.controller.observe.records import PodTimings, StepRecord
from multipod.controller.observe.report import draw, write_report
from multipod.controller.observe.report_figure import DCN_GID, OUTER_GID, figure
from multipod.controller.observe.report_input import ReportError, read_events, read_jsonl, read_metrics
from multipod.controller.observe.report_series import report_series
from tests.unit.controller.fakes import a_step_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS = 64


def _record(step: int, loss: float, pods=(0, 1), hosts=(0, 1), time: float | None = None, mfu=None) -> StepRecord:
    """A step record with per-pod timings that tell the pods and the steps apart."""
    timings = tuple(PodTimings(pod=p, compute_s=0.5 + p / 10 + step / 1000, exchange_s=0.3,
                               exposed_exchange_s=0.1 + p / 100, update_s=0.2 + step / 1000, wait_s=0.0,
                               checksum_s=0.01, idle_s=0.0, dcn_bytes_sent=100) for p in pods)
    record = a_step_record(step, loss, pods=pods, hosts=tuple(hosts), step_time_s=1.0 + step / 100, tokens=TOKENS,
                           tokens_per_s=TOKENS / (1.0 + step / 100), mfu=mfu, hfu=None if mfu is None else mfu * 1.2,
                           time=1000.0 + step if time is None else time)
    return dataclasses.replace(record, pods=timings)


def _run():
    """Ten steps of a 2-pod run: pod 1 fails during step 6, steps 6-7 run degraded on pod 0 alone,
    pod 1 rejoins at step 8; steps 4-5 were first trained, then replayed after a rewind to the
    checkpoint of step 4 (the replayed records win); evaluations after steps 4 (a first one, then
    again after the replay: the later wins) and 9. Returns the lines of metrics.jsonl (step records
    and evaluation records, in file order) and of events.jsonl."""
    records = [_record(s, 5.0 - s * 0.1) for s in range(6)]
    records += [{"step": 4, "eval_loss": 4.9, "time": 1004.6}]     # before the rewind: replaced
    records += [_record(4, 4.55, time=1006.5), {"step": 4, "eval_loss": 4.7, "time": 1006.6},
                _record(5, 4.45, time=1007.5)]   # replayed after the rewind
    records += [_record(6, 4.4, pods=(0,), hosts=(0, 0), time=1020.0),
                _record(7, 4.3, pods=(0,), hosts=(0, 0), time=1021.0),
                _record(8, 4.2, time=1022.0), _record(9, 4.1, time=1023.0),
                {"step": 9, "eval_loss": 4.25, "time": 1023.5}]
    events = [
        {"event": "checkpoint_started", "time": 1000.0, "step": 0},
        {"event": "checkpoint_saved", "time": 1000.5, "step": 0, "path": "ckpt/0"},
        {"event": "checkpoint_saved", "time": 1004.1, "step": 4, "path": "ckpt/4"},
        {"event": "rewind", "time": 1005.6, "spike_step": 5, "loss": 9.0, "mean": 4.6, "to_step": 4,
         "data_offset": 1},
        # No step: noticed while step 6 was in flight (step 5's replayed record came last before it).
        {"event": "pod_failure", "time": 1019.0, "error": "pod 1 died", "pods": [1], "mode": "degrade"},
        {"event": "degraded", "time": 1019.2, "step": 6, "live_pods": [0], "hosts": [0, 0], "failed": [1]},
        {"event": "state_transfer", "time": 1021.5, "step": 8, "donor": 0, "receiver": 1},
        {"event": "rejoin", "time": 1021.6, "step": 8, "pods": [1], "live_pods": [0, 1], "hosts": [0, 1]},
        {"event": "checkpoint_failed", "time": 1023.2, "step": 9, "error": "disk full"},
    ]
    return records, events


def _series(lines, events=()) -> dict:
    """report_series of metrics.jsonl's lines (StepRecord or evaluation dicts) and event dicts."""
    steps = [r for r in lines if isinstance(r, StepRecord)]
    evals = [r for r in lines if not isinstance(r, StepRecord)]
    return report_series(steps, evals, [Event.from_json(e) for e in events])


def _line(record) -> str:
    return (record.to_json() if isinstance(record, StepRecord) else json.dumps(record)) + "\n"


def _write_run(run_dir: pathlib.Path, records, events=None) -> pathlib.Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(_line(r) for r in records))
    if events is not None:
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_series_take_the_last_record_of_each_step_and_count_tokens():
    records, events = _run()
    series = _series(records, events)
    assert series["steps"] == list(range(10))
    assert series["loss"][4:6] == [4.55, 4.45]          # the replays, not the first tries
    assert series["loss"][:4] == [5.0, 4.9, 4.8, 4.7] and series["loss"][6:] == [4.4, 4.3, 4.2, 4.1]
    assert series["tokens"] == [TOKENS * (s + 1) for s in range(10)]
    assert series["step_time"] == [1.0 + s / 100 for s in range(10)]
    # The last evaluation of each step (step 4's after the replay), beside the step records.
    assert series["eval"] == {"steps": [4, 9], "loss": [4.7, 4.25], "tokens": [5 * TOKENS, 10 * TOKENS]}


def test_series_split_each_pods_step_time_and_leave_out_a_pod_that_was_out():
    records, events = _run()
    pods = _series(records, events)["pods"]
    assert list(pods) == [0, 1]
    assert pods[0]["steps"] == list(range(10))
    assert pods[1]["steps"] == [0, 1, 2, 3, 4, 5, 8, 9]      # out on the degraded steps 6 and 7
    assert pods[0]["compute"] == pytest.approx([0.5 + s / 1000 for s in range(10)])
    assert pods[1]["compute"] == pytest.approx([0.6 + s / 1000 for s in pods[1]["steps"]])
    assert pods[1]["exposed_exchange"] == pytest.approx([0.11] * 8)
    assert pods[0]["update"] == pytest.approx([0.2 + s / 1000 for s in range(10)])


def test_series_mark_failures_checkpoints_rewinds_rejoins_and_shade_degraded_steps():
    records, events = _run()
    series = _series(records, events)
    assert series["degraded"] == [[6, 7]]
    marks = [(m["kind"], m["step"]) for m in series["markers"]]
    assert marks == [("checkpoint", 0), ("checkpoint", 4), ("rewind", 5), ("pod_failure", 6), ("rejoin", 8),
                     ("checkpoint_failed", 9)]
    failure = next(m for m in series["markers"] if m["kind"] == "pod_failure")
    assert failure["detail"] == "pods [1]"
    rewind = next(m for m in series["markers"] if m["kind"] == "rewind")
    assert "back to step 4" in rewind["detail"]


def test_degraded_spans_are_runs_of_consecutive_steps():
    records = [_record(s, 1.0, pods=(0,) if s in (2, 3, 4, 7) else (0, 1)) for s in range(9)]
    assert _series(records)["degraded"] == [[2, 4], [7, 7]]


def test_draw_writes_a_png_of_the_expected_size_and_says_when_mfu_is_unknown(tmp_path):
    records, events = _run()
    path = tmp_path / "report.png"
    titles = draw(_series(records, events), path)
    width, height = _png_size(path)
    assert 1000 <= width <= 3000 and 800 <= height <= 3000, (width, height)
    assert path.stat().st_size > 20_000          # six panels of lines, not a blank canvas
    assert len(titles) == 7                      # six panels and the DCN bytes under the loss
    assert "MFU n/a" in titles[-1] and "HFU n/a" in titles[-1]
    assert titles[3] == "step time by phase, per pod"
    assert not list(tmp_path.glob("*.partial"))


def test_mfu_and_hfu_are_plotted_when_known(tmp_path):
    records = [_record(s, 3.0 - s / 10, mfu=0.2 + s / 100) for s in range(5)]
    records[0] = dataclasses.replace(records[0], step_time_s=30.0)   # compilation: kept off the panel's scale
    series = _series(records)
    assert series["mfu"] == pytest.approx([0.2, 0.21, 0.22, 0.23, 0.24])
    assert series["hfu"] == pytest.approx([0.24, 0.252, 0.264, 0.276, 0.288])
    titles = draw(series, tmp_path / "r.png")
    assert titles[-1] == "MFU, HFU"
    assert titles[3] == "step time by phase, per pod (first step off scale)"


def _diloco_run(steps: int = 12, period: int = 3, fragments: int = 2, pod_bytes=(900, 500)) -> list[StepRecord]:
    """A 2-pod DiLoCo run: an outer step every `period` steps (sync n after step n * period - 1),
    syncing fragment (n - 1) mod `fragments`, whose bytes (each pod's pod_bytes[fragment]) are its
    step's only DCN traffic."""
    records = []
    for step in range(steps):
        sync = (step + 1) // period if (step + 1) % period == 0 else None
        fragment = None if sync is None else (sync - 1) % fragments
        sent = 0 if sync is None else 2 * pod_bytes[fragment]
        records.append(dataclasses.replace(_record(step, 3.0 - step / 100), dcn_bytes_sent=sent, outer_sync=sync,
                                           outer_fragment=fragment, outer_seconds=0.0 if sync is None else 0.2,
                                           outer_exposed_s=0.0 if sync is None else 0.05))
    return records


def _bars(ax) -> dict[int, float]:
    """The DCN bytes panel's bars: step -> height."""
    return {round(p.get_x() + p.get_width() / 2): p.get_height() for p in ax.patches if p.get_gid() == DCN_GID}


def _outer_ticks(ax) -> list[float]:
    """The steps the outer-step ticks of a panel stand at."""
    return sorted(float(segment[0][0]) for c in ax.collections if c.get_gid() == OUTER_GID
                  for segment in c.get_segments())


def test_diloco_runs_plot_their_bytes_per_step_and_tick_the_outer_steps(tmp_path):
    series = _series(_diloco_run())
    assert series["dcn_bytes"] == [0, 0, 1800, 0, 0, 1000, 0, 0, 1800, 0, 0, 1000]
    assert series["dcn_bytes_mean"] == pytest.approx(5600 / 12)
    assert series["outer"] == {"steps": [2, 5, 8, 11], "syncs": [1, 2, 3, 4], "fragments": [0, 1, 0, 1],
                               "seconds": [0.2] * 4, "exposed_s": [0.05] * 4}
    fig, axes = figure(series)
    dcn = axes["dcn"]
    assert dcn.get_title().startswith("DCN bytes on the wire per step")
    assert dcn.get_ylabel() == "KiB per step"        # 1800 bytes at most: in KiB
    # A bar at each outer step only (the steps between sent nothing), in KiB.
    assert _bars(dcn) == pytest.approx({2: 1800 / 1024, 5: 1000 / 1024, 8: 1800 / 1024, 11: 1000 / 1024})
    labels = dcn.get_legend_handles_labels()[1]
    assert labels == ["mean: 0.5 KiB per step", "outer step: bytes sent, all pods"]
    # The loss panel ticks the outer steps, once in its legend; the bytes share the loss's steps.
    assert _outer_ticks(axes["loss"]) == [2.0, 5.0, 8.0, 11.0]
    assert axes["loss"].get_legend_handles_labels()[1].count("outer step (DiLoCo)") == 1
    assert dcn.get_shared_x_axes().joined(dcn, axes["loss"])
    titles = draw(series, tmp_path / "report.png")
    assert titles[:3] == ["loss by step", "DCN bytes on the wire per step (every pod's, after compression)",
                          "loss by tokens trained"]
    assert _png_size(tmp_path / "report.png")


def test_every_step_runs_plot_their_constant_bytes_and_no_outer_step():
    records, events = _run()        # every step sends 100 bytes per live pod (pod 0 alone on 6 and 7)
    series = _series(records, events)
    sent = [100 if s in (6, 7) else 200 for s in range(10)]
    assert series["dcn_bytes"] == sent and series["outer"]["steps"] == []
    _, axes = figure(series)
    assert _bars(axes["dcn"]) == dict(enumerate(sent))
    assert axes["dcn"].get_ylabel() == "B per step"
    assert axes["dcn"].get_legend_handles_labels()[1] == ["mean: 180.0 B per step", "bytes sent, all pods"]
    assert _outer_ticks(axes["loss"]) == [] and _outer_ticks(axes["dcn"]) == []
    assert "outer step (DiLoCo)" not in axes["loss"].get_legend_handles_labels()[1]
    # One pod alone puts nothing on the DCN: the panel says so instead of drawing an empty axis.
    lone = _series([a_step_record(s, 2.0, pods=(0,), dcn_bytes_sent=0) for s in range(3)])
    _, axes = figure(lone)
    assert _bars(axes["dcn"]) == {}
    assert [t.get_text() for t in axes["dcn"].texts] == ["no bytes on the DCN (one pod?)"]


def test_a_metrics_file_from_before_diloco_draws_with_no_outer_step(tmp_path):
    lines = []
    for step in range(3):
        line = _record(step, 2.0).to_dict()
        for key in ("outer_sync", "outer_fragment", "outer_seconds", "outer_exposed_s"):
            del line[key]
        lines.append(json.dumps(line) + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    assert _png_size(write_report(run_dir))
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    assert _series(records)["outer"]["steps"] == [] and _series(records)["dcn_bytes"] == [200] * 3


def test_write_report_reads_the_run_directory(tmp_path):
    records, events = _run()
    run_dir = _write_run(tmp_path / "run", records, events)
    path = write_report(run_dir)
    assert path == run_dir / "report.png"
    _png_size(path)
    # Without events.jsonl and to another path.
    (run_dir / "events.jsonl").unlink()
    other = write_report(run_dir, tmp_path / "elsewhere.png")
    assert other == tmp_path / "elsewhere.png" and _png_size(other)


def test_the_report_command_prints_the_path(tmp_path, capsys):
    run_dir = _write_run(tmp_path / "run", [_record(s, 2.0) for s in range(3)])
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.png")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "x.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "x.png")
    assert _png_size(tmp_path / "x.png")


@pytest.mark.parametrize("content, expected", [
    (None, "no such file"),
    ("", "empty"),
    ("\n\n", "empty"),
    ('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.9}\n{"step": 2, "lo\n', "line 3: not valid JSON"),
    ('{"step": 0, "loss": 1.0}\n[1, 2]\n', "line 2: expected a JSON object"),
    ('{"loss": 1.0}\n', "line 1: no integer \"step\""),
    ('{"step": 0, "eval_loss": 1.0}\n', "no record of a training step"),
    ('{"step": 0, "loss": 1.0}\n', "line 1: not a step record: a StepRecord without z_loss"),
    (a_step_record(0, 1.0).to_json() + "\n" + a_step_record(1, 1.0, tokens=1.5).to_json() + "\n",
     "line 2: not a step record: tokens is float 1.5, not int"),
])
def test_bad_metrics_get_an_error_that_names_the_file(tmp_path, capsys, content, expected):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    if content is not None:
        metrics.write_text(content)
    with pytest.raises(ReportError) as caught:
        write_report(run_dir)
    assert str(metrics) in str(caught.value) and expected in str(caught.value)
    assert not (run_dir / "report.png").exists()
    # The command prints it and fails.
    assert main(["report", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(metrics) in err and expected in err


def test_the_report_reads_step_records_evaluations_and_events_from_the_run_directory(tmp_path):
    records, events = _run()
    old = a_step_record(10, 4.0).to_dict()       # a line of a run from before the checksum renaming
    old["fingerprints"], old["full_fingerprints"] = old.pop("checksums"), old.pop("fingerprints")
    old["fingerprint_time_s"] = old.pop("checksum_time_s")
    old["pods"] = [{**p, "fingerprint_s": p.pop("checksum_s")} for p in old["pods"]]
    run_dir = _write_run(tmp_path / "run", records + [old], events + [{"event": "lunch", "time": 1.0}])
    steps, evals = read_metrics(run_dir / "metrics.jsonl")
    assert steps == [r for r in records if isinstance(r, StepRecord)] + [a_step_record(10, 4.0)]
    assert evals == [r for r in records if not isinstance(r, StepRecord)]
    read = read_events(run_dir / "events.jsonl")          # the kind it does not know is left out
    assert [e.kind.value for e in read] == [e["event"] for e in events]
    assert read[3].get("to_step") == 4 and read[3].time == 1005.6


def test_a_torn_last_line_is_left_out_with_a_warning_and_one_in_the_middle_is_an_error(tmp_path, caplog):
    # A write cut short (a full disk, a crash) leaves the last line without its newline.
    run_dir = _write_run(tmp_path / "run", [_record(s, 2.0) for s in range(3)])
    metrics = run_dir / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 3, "lo')
    steps, _ = read_metrics(metrics)
    assert [r.step for r in steps] == [0, 1, 2]
    assert "metrics.jsonl, line 4: cut short" in caplog.text
    assert write_report(run_dir).exists()
    metrics.write_text(whole + '{"step": 3, "lo\n')      # with its newline, it is not torn: malformed
    with pytest.raises(ReportError, match="line 4: not valid JSON"):
        read_metrics(metrics)


def test_a_malformed_event_line_is_named_too(tmp_path):
    run_dir = _write_run(tmp_path / "run", [_record(0, 1.0)])
    (run_dir / "events.jsonl").write_text('{"event": "checkpoint_saved", "step": 0}\nnot json\n')
    with pytest.raises(ReportError, match=r"events\.jsonl, line 2: not valid JSON"):
        write_report(run_dir)
    (run_dir / "events.jsonl").write_text('{"event": "checkpoint_saved", "step": 0}\n')
    with pytest.raises(ReportError, match=r"events\.jsonl, line 1: event 'checkpoint_saved' has no number \"time\""):
        write_report(run_dir)
    assert read_jsonl(run_dir / "nothing.jsonl", required=False) == []


def test_a_missing_run_directory_is_named(tmp_path):
    with pytest.raises(ReportError, match="no such run directory"):
        write_report(tmp_path / "nope")


def test_the_end_of_a_local_run_warns_instead_of_failing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_report_quietly(run_dir)                    # no metrics yet (the run failed early): nothing
    assert capsys.readouterr() == ("", "")
    (run_dir / "metrics.jsonl").write_text(_record(0, 2.0).to_json() + '\n{"step": 1, "lo\n')   # malformed
    write_report_quietly(run_dir)
    err = capsys.readouterr().err
    assert "warning: no report drawn" in err and "line 2" in err
    assert not (run_dir / "report.png").exists()
    _write_run(run_dir, [_record(s, 2.0) for s in range(3)])
    write_report_quietly(run_dir)
    assert capsys.readouterr().out.strip() == f"report: {run_dir / 'report.png'}"
    assert _png_size(run_dir / "report.png")
