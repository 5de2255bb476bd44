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
from tests.unit.controller.fakes import DEAD, SERVING, FakeCall, FakePod, make_config


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
    # ... and was told where a DiLoCo run of the same directory keeps its parts, not to go back past them.
    assert list(pods[0].calls[-1][1].diloco_directories) == ["ckpt/pod-0", "ckpt/pod-1"]


# -- DiLoCo: one part per slot, a failed slot's written on its behalf -----------------------------
class PartsPod(WriterPod):
    """A DiLoCo pod as a checkpoint writer: its WaitSave calls are kept by (directory, step)."""

    def wait_save_async(self, request, timeout_s):
        self.waits[(request.directory, request.step)] = FakeCall(pending=True)
        return self.waits[(request.directory, request.step)]


def _diloco_checkpointer(tmp_path, hosts: list[int], on_pod_failure: str = "replay"):
    pods = [PartsPod(i) for i in range(len(hosts))]
    config = make_config(run={"steps": 10}, checkpoint={"every": 2},
                         sync={"mode": "diloco", "inner_steps": 4, "on_pod_failure": on_pod_failure})
    cluster = Cluster(pods, config)
    cluster.hosts = list(hosts)
    return Checkpointer(config.checkpoint, cluster, "ckpt", EventLog(tmp_path / "events.jsonl")), pods


def _saves(pod) -> list[tuple[str, int | None]]:
    """(directory, slot or None) of each Save the pod got, in order."""
    return [(r.directory, r.slot if r.HasField("slot") else None) for m, r in pod.calls if m == "Save"]


@pytest.mark.parametrize("on_pod_failure, writer", [("replay", 2), ("drop", 1)])
def test_a_diloco_checkpoint_while_a_pod_is_out_has_every_slot_s_part_and_is_good_only_when_all_are_written(
        tmp_path, on_pod_failure, writer):
    """Pod 0 is out, its slot hosted by pod 2: its part is written by the pod holding its state, the
    replica's host with "replay", the first live pod (which a rejoin copies) with "drop"; the
    checkpoint is good only once every part is written, and a failed part never makes it good."""
    checkpointer, pods = _diloco_checkpointer(tmp_path, [2, 1, 2], on_pod_failure)
    checkpointer.save(4)
    others = {1: [("ckpt/pod-1", None)], 2: [("ckpt/pod-2", None)]}
    others[writer] = others[writer] + [("ckpt/pod-0", 0)]     # its own part first, then the slot's
    assert {i: _saves(pods[i]) for i in (0, 1, 2)} == {0: [], **others}
    assert checkpointer.pending[0].path == "ckpt/pod-0/4"   # the checkpoint is named by slot 0's part
    waits = {(pod.pod_index, directory): call for pod in pods for (directory, _step), call in pod.waits.items()}
    assert sorted(waits) == sorted([(writer, "ckpt/pod-0"), (1, "ckpt/pod-1"), (2, "ckpt/pod-2")])
    for key in [(1, "ckpt/pod-1"), (2, "ckpt/pod-2")]:
        waits[key].finish(pb.SaveReply(path=f"{key[1]}/4"))
    checkpointer.collect(block=False)
    assert checkpointer.last_good is None, "good before the failed slot's part was written"
    waits[(writer, "ckpt/pod-0")].finish(pb.SaveReply(path="ckpt/pod-0/4"))
    checkpointer.collect(block=False)
    assert checkpointer.last_good == Saved(4, "ckpt/pod-0/4") and checkpointer.failed == 0
    assert checkpointer.part_path(0, checkpointer.last_good) == "ckpt/pod-0/4"

    checkpointer.save(6)
    waits = {(pod.pod_index, directory): call for pod in pods for (directory, step), call in pod.waits.items()
             if step == 6}
    waits[(writer, "ckpt/pod-0")].finish(error=WorkerError(f"pod {writer}: WaitSave failed: INTERNAL: disk full",
                                                           grpc.StatusCode.INTERNAL))
    for key in [(1, "ckpt/pod-1"), (2, "ckpt/pod-2")]:
        waits[key].finish(pb.SaveReply(path=f"{key[1]}/6"))
    checkpointer.collect(block=True)
    assert checkpointer.last_good == Saved(4, "ckpt/pod-0/4") and checkpointer.failed == 1


def test_a_diloco_part_the_writer_refuses_fails_the_checkpoint_naming_why(tmp_path, capsys):
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 0])
    refused = WorkerError("pod 0: Save failed: INVALID_ARGUMENT: pod 0 does not host slot 1's replica",
                          grpc.StatusCode.INVALID_ARGUMENT)
    pods[0].save = lambda request, timeout_s: (_ for _ in ()).throw(refused) if request.HasField("slot") else \
        pb.SaveReply(path=f"{request.directory}/{request.step}", pending=True)
    checkpointer.save(2)
    assert checkpointer.pending == [] and checkpointer.failed == 1 and checkpointer.last_good is None
    assert "does not host slot 1's replica" in capsys.readouterr().out


def test_a_healthy_diloco_checkpoint_is_every_pod_s_own(tmp_path):
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1])
    checkpointer.save(2)
    assert [_saves(pod) for pod in pods] == [[("ckpt/pod-0", None)], [("ckpt/pod-1", None)]]


def test_a_diloco_writer_that_dies_mid_save_is_a_pod_failure_though_every_part_failed(tmp_path):
    """Pod 1 dies while every pod saves its part: its peers' saves fail too (the outer exchange the
    save finishes breaks), yet the run is told of a pod failure naming pod 1, not a run error."""
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1, 2])
    pods[1].probe_then = DEAD
    for pod in pods:
        pod.refuse[4] = WorkerError(f"pod {pod.pod_index}: Save failed: UNAVAILABLE: pod 1 is gone",
                                    grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(PodFailure) as info:
        checkpointer.save(4)
    assert info.value.pods == (1,) and "checkpoint of step 4" in str(info.value)
    assert "pod 0: Save failed" in str(info.value) and "pod 2: Save failed" in str(info.value)
    assert checkpointer.pending == []
    # Refused outright by two pods (not a failure of theirs): reported with both reasons, no pod failure.
    for pod in pods:
        pod.refuse[6] = WorkerError(f"pod {pod.pod_index}: Save failed: FAILED_PRECONDITION: no",
                                    grpc.StatusCode.FAILED_PRECONDITION)
    pods[1].probe_then = SERVING
    checkpointer.save(6)
    assert checkpointer.failed == 1 and checkpointer.pending == []
    (failed,) = [e for e in _events(tmp_path) if e["event"] == "checkpoint_failed"]
    assert failed["step"] == 6 and "pod 0: Save failed" in failed["error"] and "pod 2: Save failed" in failed["error"]
