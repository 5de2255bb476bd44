"""The checkpointer's bookkeeping: when it saves, the saves in flight, the last good checkpoint."""
from __future__ import annotations

import json

import grpc
import pytest

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster
from multipod.controller.components.checkpointer import Checkpointer, Saved
from multipod.controller.core.errors import PodFailure
from multipod.controller.core.run_config import ConfigError
from multipod.controller.observe.events import EventLog
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.fakes import DEAD, FakeCall, FakePod, make_config


class WriterPod(FakePod):
    """Pod 0 as the checkpoint writer: Save answers at once, WaitSave stays pending until the
    test finishes it; `refuse` maps a step to the error its Save RPC gets."""

    def __init__(self, pod_index: int = 0, **kwargs):
        super().__init__(pod_index, **kwargs)
        self.waits: dict[int, FakeCall] = {}
        self.refuse: dict[int, WorkerError] = {}
        self.metadata = {"data_path": "", "data_offset": 0}

    def save(self, request, timeout_s):
        self.calls.append(("Save", request))
        if request.step in self.refuse:
            raise self.refuse[request.step]
        return pb.SaveReply(path=f"{request.directory}/{request.step}", pending=True)

    def restore(self, request, timeout_s):
        self.calls.append(("Restore", request))
        step = int((request.path or "x/7").rsplit("/", 1)[1])
        return pb.RestoreReply(step=step, fingerprint="fp", path=request.path or "ckpt/7",
                               metadata_json=json.dumps(self.metadata))

    def wait_save_async(self, request, timeout_s):
        assert request.directory == "ckpt"
        self.waits[request.step] = FakeCall(pending=True)
        return self.waits[request.step]


def _checkpointer(tmp_path, pods=None, steps: int = 5, every: int = 0):
    """A Checkpointer of a run of `steps` steps saving every `every` (checkpoint.every)."""
    pods = pods or [WriterPod(), WriterPod(1)]
    config = make_config(run={"steps": steps}, checkpoint={"every": every})
    return (Checkpointer(config.checkpoint, Cluster(pods, config), "ckpt", EventLog(tmp_path / "events.jsonl")),
            pods[0])


def _events(tmp_path):
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def _boundaries(checkpointer, steps):
    drained = []
    for step in steps:
        checkpointer.on_step(step, lambda step=step: drained.append(step))
    return drained


def test_saves_a_baseline_every_n_steps_and_at_the_end_draining_first(tmp_path):
    checkpointer, writer = _checkpointer(tmp_path, steps=10, every=3)
    drained = _boundaries(checkpointer, range(0, 11))
    assert drained == [0, 3, 6, 9, 10]
    assert [r.step for m, r in writer.calls if m == "Save"] == [0, 3, 6, 9, 10]
    assert all(r.background for m, r in writer.calls if m == "Save")


def test_a_resumed_or_restored_start_is_not_saved_again(tmp_path):
    checkpointer, writer = _checkpointer(tmp_path, steps=8, every=3)
    checkpointer.last_good = Saved(6, "ckpt/6")       # as after a restore of step 6
    assert _boundaries(checkpointer, range(6, 9)) == [8]
    checkpointer, writer = _checkpointer(tmp_path, steps=8, every=0)
    assert _boundaries(checkpointer, range(2, 9)) == [2, 8]   # only the baseline and the end


def test_last_good_is_set_only_by_a_finished_save_and_pending_saves_are_collected(tmp_path):
    checkpointer, writer = _checkpointer(tmp_path, steps=10, every=3)
    _boundaries(checkpointer, range(0, 4))
    assert [p.step for p in checkpointer.pending] == [0, 3] and checkpointer.last_good is None
    writer.waits[0].finish(pb.SaveReply(path="ckpt/0"))
    checkpointer.collect(block=False)
    assert checkpointer.last_good == Saved(0, "ckpt/0") and [p.step for p in checkpointer.pending] == [3]
    writer.waits[3].finish(pb.SaveReply(path="ckpt/3"))
    checkpointer.on_step(4, lambda: None)       # every boundary collects what has finished
    assert checkpointer.last_good == Saved(3, "ckpt/3") and checkpointer.pending == []
    assert [e["step"] for e in _events(tmp_path) if e["event"] == "checkpoint_saved"] == [0, 3]


def test_a_failed_save_is_reported_at_once_and_never_replaces_the_last_good(tmp_path, capsys):
    checkpointer, writer = _checkpointer(tmp_path, steps=10, every=3)
    _boundaries(checkpointer, range(0, 4))
    writer.waits[0].finish(pb.SaveReply(path="ckpt/0"))
    writer.waits[3].finish(error=WorkerError("pod 0: WaitSave failed: INTERNAL: disk full", grpc.StatusCode.INTERNAL))
    checkpointer.collect(block=False)
    assert checkpointer.last_good == Saved(0, "ckpt/0") and checkpointer.failed == 1
    assert "ERROR: checkpoint of step 3 FAILED" in capsys.readouterr().out
    # A save the worker refuses outright is reported too, and nothing is left pending.
    writer.refuse[6] = WorkerError("pod 0: Save failed: FAILED_PRECONDITION: no", grpc.StatusCode.FAILED_PRECONDITION)
    _boundaries(checkpointer, range(4, 7))
    assert checkpointer.failed == 2 and checkpointer.pending == [] and checkpointer.last_good.step == 0
    assert "The last good checkpoint is still ckpt/0 (step 0)" in capsys.readouterr().out
    assert [e["step"] for e in _events(tmp_path) if e["event"] == "checkpoint_failed"] == [3, 6]


def test_the_newest_finished_save_wins(tmp_path):
    checkpointer, writer = _checkpointer(tmp_path, steps=10, every=3)
    _boundaries(checkpointer, range(0, 7))
    writer.waits[6].finish(pb.SaveReply(path="ckpt/6"))
    checkpointer.collect(block=False)
    writer.waits[3].finish(pb.SaveReply(path="ckpt/3"))   # an older save that finishes later
    writer.waits[0].finish(pb.SaveReply(path="ckpt/0"))
    checkpointer.collect(block=True)
    assert checkpointer.last_good == Saved(6, "ckpt/6")


def test_a_writer_that_does_not_answer_is_a_pod_failure(tmp_path):
    writer = WriterPod(probe_then=DEAD)
    writer.refuse[0] = WorkerError("pod 0: Save failed: UNAVAILABLE", grpc.StatusCode.UNAVAILABLE)
    checkpointer, _ = _checkpointer(tmp_path, pods=[writer, WriterPod(1)])
    with pytest.raises(PodFailure) as info:
        checkpointer.on_step(0, lambda: None)
    assert info.value.pods == (0,) and "checkpoint of step 0" in str(info.value)


def test_resume_refuses_a_checkpoint_trained_on_other_data_and_takes_its_data_offset(tmp_path):
    pods = [WriterPod(), WriterPod(1)]
    for pod in pods:
        pod.metadata = {"data_path": "/elsewhere", "data_offset": 0}
    checkpointer, _ = _checkpointer(tmp_path, pods=pods)
    with pytest.raises(ConfigError, match="data.path"):
        checkpointer.resume()
    for pod in pods:
        pod.metadata = {"data_path": "", "data_offset": 4}
    assert checkpointer.resume() == 7
    assert checkpointer.data_offset == 4 and checkpointer.last_good == Saved(7, "ckpt/7")
    # Pod 0 found the newest checkpoint in the directory; the other pod restored that one.
    assert pods[0].calls[-1][1].directory == "ckpt" and pods[1].calls[-1][1].path == "ckpt/7"
