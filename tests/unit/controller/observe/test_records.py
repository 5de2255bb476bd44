"""StepRecord, the schema of metrics.jsonl's step lines: the record step_record builds from the
pods' replies (the loss summed over shards in slot order), its JSON and back, and what reading a
line refuses or forgives."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from multipod.controller.observe.metrics import Accounting, step_record
from multipod.controller.observe.records import PodTimings, StepRecord
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.fakes import a_step_record

POSITION = dict(data_index=7, epoch=0.5, skipped_steps=1, restarts=2)


def _reply(pod: int, shards: list[tuple[int, float]], tokens: int = 10) -> pb.StepReply:
    """pod's StepReply computing `shards` ((slot, loss_sum), own first) of `tokens` tokens each."""
    results = [pb.ShardResult(slot=slot, loss_sum=loss, z_loss_sum=loss / 10, tokens=tokens) for slot, loss in shards]
    return pb.StepReply(pod_index=pod, loss_sum=sum(loss for _, loss in shards), tokens=tokens * len(shards),
                        checksum="c", shards=results, dcn_bytes_sent=3,
                        timings=pb.StepTimings(compute_s=0.1 * (pod + 1), checksum_s=0.01))


def test_the_loss_is_summed_over_the_shards_in_slot_order_whatever_the_reply_order():
    # Floating-point sums depend on their order: 1e16 + 1 rounds back to 1e16, so slot order
    # (1e16, 1, -1e16) gives 0 where reply order (-1e16, 1e16, 1) would give 1.
    replies = [_reply(2, [(2, -1e16)]), _reply(0, [(0, 1e16), (1, 1.0)])]
    record = step_record(5, replies, 2.0, Accounting(model_flops_per_token=6.0), hosts=[0, 0, 2], **POSITION)
    assert record.loss == 0.0 and record.tokens == 30 and record.tokens_per_s == 15.0
    assert record.hosts == (0, 0, 2) and record.live_pods == 2
    assert [p.pod for p in record.pods] == [2, 0] and record.compute_time_s == pytest.approx(0.3)
    assert record.dcn_bytes_sent == 6 and record.checksums == ("c", "c") and record.fingerprints is None
    assert (record.data_index, record.epoch, record.skipped_steps, record.restarts) == (7, 0.5, 1, 2)
    assert not record.partial_loss


def test_a_record_goes_to_json_and_back_unchanged():
    record = a_step_record(3, 2.5, fingerprints=("f0", "f1"), mfu=0.4, partial_loss=True)
    line = record.to_json()
    assert "\n" not in line
    data = json.loads(line)
    assert data["checksums"] == ["c3", "c3"] and data["pods"][1]["pod"] == 1 and data["mfu"] == 0.4
    assert set(data) == {f.name for f in dataclasses.fields(StepRecord)}
    back = StepRecord.from_json(line)
    assert back == record and isinstance(back.pods[0], PodTimings) and isinstance(back.hosts, tuple)
    assert StepRecord.from_json(data) == record        # from the parsed object too
    nan = dataclasses.replace(record, loss=math.nan)   # a diverged step's record still reads back
    assert math.isnan(StepRecord.from_json(nan.to_json()).loss)


def test_unknown_keys_are_ignored_and_older_names_read_as_the_new_ones():
    data = a_step_record(0, 1.0).to_dict()
    assert StepRecord.from_json({**data, "from_a_newer_version": 1}) == a_step_record(0, 1.0)
    # A line written before the checksum/fingerprint renaming (protocol 6).
    old = {k: v for k, v in data.items() if k not in ("checksums", "fingerprints", "checksum_time_s",
                                                       "fingerprint_time_s")}
    old.update(fingerprints=["c0", "c0"], full_fingerprints=None, fingerprint_time_s=0.25)
    old["pods"] = [{("fingerprint_s" if k == "checksum_s" else k): v for k, v in p.items() if k != "fingerprint_s"}
                   for p in data["pods"]]
    record = StepRecord.from_json(old)
    assert record.checksums == ("c0", "c0") and record.fingerprints is None
    assert record.checksum_time_s == 0.25 and record.fingerprint_time_s == 0.0
    assert [p.checksum_s for p in record.pods] == [p["checksum_s"] for p in data["pods"]]


@pytest.mark.parametrize("change, message", [
    ({"loss": None}, "loss is null"),
    ({"step": "3"}, "step is str '3', not int"),
    ({"skipped": 1}, "skipped is int 1, not bool"),
    ({"hosts": [0, "1"]}, "hosts[] is str '1', not int"),
    ({"pods": [{"pod": 0}]}, "a PodTimings without pods[].compute_s"),
])
def test_a_malformed_line_is_refused_naming_the_field(change, message):
    with pytest.raises(ValueError) as caught:
        StepRecord.from_json({**a_step_record(0, 1.0).to_dict(), **change})
    assert message in str(caught.value)


def test_missing_fields_are_named():
    data = a_step_record(0, 1.0).to_dict()
    del data["tokens"], data["epoch"]
    with pytest.raises(ValueError, match="a StepRecord without tokens, epoch"):
        StepRecord.from_json(data)
    with pytest.raises(ValueError, match="must be a JSON object"):
        StepRecord.from_json("[1, 2]")
