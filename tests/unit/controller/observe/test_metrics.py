"""The metric record of one step."""
from __future__ import annotations

import math

from multipod.controller.observe.metrics import Accounting, Recorder, step_record
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.fakes import ListSink, NoProgress


def _replies():
    return [pb.StepReply(loss_sum=10.0, z_loss_sum=1.0, tokens=10, checksum="f", dcn_bytes_sent=5,
                         timings=pb.StepTimings(compute_s=0.5, exchange_s=0.1, update_s=0.3)),
            pb.StepReply(loss_sum=30.0, z_loss_sum=3.0, tokens=10, checksum="f", dcn_bytes_sent=7,
                         timings=pb.StepTimings(compute_s=0.2, exchange_s=0.4, update_s=0.1))]


def test_loss_is_the_sum_of_loss_sums_over_all_tokens_and_timings_are_the_slowest_pod():
    record = step_record(3, _replies(), 2.0, Accounting(model_flops_per_token=6.0))
    assert record["step"] == 3 and record["loss"] == 2.0 and record["z_loss"] == 0.2
    assert (record["compute_time_s"], record["exchange_time_s"], record["update_time_s"]) == (0.5, 0.4, 0.3)
    assert record["tokens"] == 20 and record["tokens_per_s"] == 10.0 and record["dcn_bytes_sent"] == 12
    assert [p["compute_s"] for p in record["pods"]] == [0.5, 0.2]


def test_mfu_is_none_without_a_peak_and_exact_with_one():
    assert step_record(0, _replies(), 2.0, Accounting(model_flops_per_token=6.0))["mfu"] is None
    record = step_record(0, _replies(), 2.0, Accounting(model_flops_per_token=6.0, peak_flops=100.0,
                                                        num_devices=2, hardware_flops_per_step=160.0))
    # 10 tokens/s x 6 FLOP/token over 2 devices x 100 FLOP/s.
    assert math.isclose(record["mfu"], 0.3)
    # Hardware: 160 FLOP / 20 tokens = 8 FLOP/token -> 80 FLOP/s over 200.
    assert record["hardware_flops_per_token"] == 8.0 and math.isclose(record["hfu"], 0.4)


def test_recorder_keeps_the_latest_record_of_a_replayed_step_and_counts_skips():
    sink = ListSink()
    recorder = Recorder(sink, NoProgress())
    for step, loss in ((0, 3.0), (1, 2.5), (1, 2.4)):
        recorder.write({"step": step, "loss": loss})
    assert [r["loss"] for r in recorder.in_order()] == [3.0, 2.4] and len(sink.records) == 3
    assert recorder.note_skipped(4, True) == 1 and recorder.note_skipped(4, True) == 1
    assert recorder.note_skipped(5, False) == 1


def test_the_record_shows_the_exposed_exchange_checksum_and_fingerprint_per_pod_and_at_most():
    replies = _replies()
    replies[0].timings.exposed_exchange_s, replies[1].timings.exposed_exchange_s = 0.02, 0.05
    replies[0].timings.checksum_s, replies[1].timings.checksum_s = 0.004, 0.003
    replies[0].timings.idle_s, replies[1].timings.idle_s = 0.01, 0.0
    record = step_record(0, replies, 2.0, Accounting(model_flops_per_token=6.0))
    assert [p["exposed_exchange_s"] for p in record["pods"]] == [0.02, 0.05]
    assert [p["checksum_s"] for p in record["pods"]] == [0.004, 0.003]
    assert (record["exposed_exchange_s"], record["checksum_time_s"], record["idle_time_s"]) == (0.05, 0.004, 0.01)
    assert record["checksums"] == ["f", "f"] and record["fingerprints"] is None
    assert record["fingerprint_time_s"] == 0.0
    for reply in replies:
        reply.fingerprint = "blake"
        reply.timings.fingerprint_s = 0.2
    record = step_record(0, replies, 2.0, Accounting(model_flops_per_token=6.0))
    assert record["fingerprints"] == ["blake"] * 2 and record["fingerprint_time_s"] == 0.2
