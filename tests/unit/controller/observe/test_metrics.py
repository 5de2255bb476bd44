"""The metric record of one step."""
from __future__ import annotations

import json
import math

from multipod.controller.observe.metrics import Accounting, MetricsLog, Recorder, step_record
from multipod.controller.observe.records import StepRecord
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.fakes import ListSink, NoProgress, a_step_record

POSITION = dict(data_index=0, epoch=0.1, skipped_steps=0, restarts=0)


def _replies():
    return [pb.StepReply(loss_sum=10.0, z_loss_sum=1.0, tokens=10, checksum="f", dcn_bytes_sent=5,
                         timings=pb.StepTimings(compute_s=0.5, exchange_s=0.1, update_s=0.3)),
            pb.StepReply(loss_sum=30.0, z_loss_sum=3.0, tokens=10, checksum="f", dcn_bytes_sent=7,
                         timings=pb.StepTimings(compute_s=0.2, exchange_s=0.4, update_s=0.1))]


def _record(replies=None, step=0, accounting=None) -> StepRecord:
    return step_record(step, _replies() if replies is None else replies, 2.0,
                       accounting or Accounting(model_flops_per_token=6.0), **POSITION)


def test_loss_is_the_sum_of_loss_sums_over_all_tokens_and_timings_are_the_slowest_pod():
    record = _record(step=3)
    assert record.step == 3 and record.loss == 2.0 and record.z_loss == 0.2
    assert (record.compute_time_s, record.exchange_time_s, record.update_time_s) == (0.5, 0.4, 0.3)
    assert record.tokens == 20 and record.tokens_per_s == 10.0 and record.dcn_bytes_sent == 12
    assert [p.compute_s for p in record.pods] == [0.5, 0.2]


def test_mfu_is_none_without_a_peak_and_exact_with_one():
    assert _record().mfu is None
    record = _record(accounting=Accounting(model_flops_per_token=6.0, peak_flops=100.0, num_devices=2,
                                           hardware_flops_per_step=160.0))
    # 10 tokens/s x 6 FLOP/token over 2 devices x 100 FLOP/s.
    assert math.isclose(record.mfu, 0.3)
    # Hardware: 160 FLOP / 20 tokens = 8 FLOP/token -> 80 FLOP/s over 200.
    assert record.hardware_flops_per_token == 8.0 and math.isclose(record.hfu, 0.4)


def test_recorder_keeps_the_latest_record_of_a_replayed_step_and_counts_skips():
    sink = ListSink()
    recorder = Recorder(sink, NoProgress())
    for step, loss in ((0, 3.0), (1, 2.5), (1, 2.4)):
        recorder.write(a_step_record(step, loss))
    recorder.write_eval({"step": 1, "eval_loss": 2.6})
    assert [r.loss for r in recorder.in_order()] == [3.0, 2.4] and len(sink.records) == 3
    assert sink.evals == [{"step": 1, "eval_loss": 2.6}]
    assert recorder.note_skipped(4, True) == 1 and recorder.note_skipped(4, True) == 1
    assert recorder.note_skipped(5, False) == 1


def test_the_record_shows_the_exposed_exchange_waits_checksum_and_fingerprint_per_pod_and_at_most():
    replies = _replies()
    replies[0].timings.exposed_exchange_s, replies[1].timings.exposed_exchange_s = 0.02, 0.05
    replies[0].timings.checksum_s, replies[1].timings.checksum_s = 0.004, 0.003
    replies[0].timings.idle_s, replies[1].timings.idle_s = 0.01, 0.0
    replies[0].timings.peer_wait_s, replies[0].timings.wire_wait_s = 0.006, 0.003
    record = _record(replies)
    assert [p.exposed_exchange_s for p in record.pods] == [0.02, 0.05]
    assert [(p.peer_wait_s, p.wire_wait_s) for p in record.pods] == [(0.006, 0.003), (0.0, 0.0)]
    assert [p.checksum_s for p in record.pods] == [0.004, 0.003]
    assert (record.exposed_exchange_s, record.checksum_time_s, record.idle_time_s) == (0.05, 0.004, 0.01)
    assert record.checksums == ("f", "f") and record.fingerprints is None and record.fingerprint_time_s == 0.0
    for reply in replies:
        reply.fingerprint = "blake"
        reply.timings.fingerprint_s = 0.2
    record = _record(replies)
    assert record.fingerprints == ("blake", "blake") and record.fingerprint_time_s == 0.2


def test_metrics_jsonl_holds_one_line_per_step_and_per_evaluation(tmp_path):
    log = MetricsLog(tmp_path)
    record = a_step_record(0, 2.5, mfu=0.25)
    log.write(record)
    log.write_eval({"step": 0, "trained_steps": 1, "eval_loss": 2.7})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and StepRecord.from_json(lines[0]) == record
    assert json.loads(lines[1]) == {"step": 0, "trained_steps": 1, "eval_loss": 2.7}


def test_a_resumed_run_appends_after_the_whole_lines_and_a_new_one_starts_afresh(tmp_path):
    first = a_step_record(0, 2.5)
    (tmp_path / "metrics.jsonl").write_text(first.to_json() + '\n{"step": 1, "lo')    # torn by a full disk
    log = MetricsLog(tmp_path, append=True)                  # --resume
    log.write(a_step_record(1, 2.4))
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [StepRecord.from_json(line).step for line in lines] == [0, 1]
    MetricsLog(tmp_path).close()                             # a new run
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_progress_line_shows_a_hot_swap_at_once_and_keeps_showing_it(capsys):
    # Off a terminal the line prints every 5 s, but at once when the membership changes: a pod
    # lost (degraded), back, or its slot taken by a spare (hot_swaps, counted in the record).
    import dataclasses
    import io

    from rich.console import Console

    from multipod.controller.observe.metrics import ProgressLine
    progress = ProgressLine(10, console=Console(file=io.StringIO(), force_terminal=False))
    healthy = step_record(0, _replies(), 2.0, Accounting(model_flops_per_token=6.0), **POSITION)
    assert healthy.hot_swaps == 0
    progress.update(healthy)                                     # the first line
    progress.update(dataclasses.replace(healthy, step=1))        # within 5 s: not printed
    progress.update(dataclasses.replace(healthy, step=2, hot_swaps=1))
    progress.update(dataclasses.replace(healthy, step=3, hot_swaps=1))   # unchanged: not printed
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1/10", "3/10"]
    assert "hot-swapped" not in lines[0] and lines[1].endswith("hot-swapped 1")
    swapped = step_record(4, _replies(), 2.0, Accounting(model_flops_per_token=6.0), **POSITION, hot_swaps=2)
    assert swapped.hot_swaps == 2 and StepRecord.from_json(swapped.to_json()).hot_swaps == 2
