"""--resume of a DiLoCo run takes the newest whole checkpoint: the first pod chooses the newest step
every pod's part holds complete (RestoreRequest.parts), the controller says which newer ones it
skipped and why (RestoreReply.skipped), and a part another pod cannot read back (DATA_LOSS) sends
the choice one checkpoint further back. With no part saved yet, a warm start: every pod takes the
newest every-step checkpoint of the run's own directory or of checkpoint.warm_start_from."""
from __future__ import annotations

import dataclasses
import json

import grpc
import pytest

from multipod.controller.cluster.client import WorkerError
from multipod.controller.components.checkpointer import Saved
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.components.test_checkpointer import _diloco_checkpointer


def _chooser(pods, whole: list[int], skipped: dict[int, dict[int, int]]):
    """Pod 0 answers a restore from its directory with the newest of `whole` below before_step,
    reporting the newer steps of `skipped` ({step: {pod: PartState}}) as passed over."""
    def restore(request, timeout_s):
        pods[0].calls.append(("Restore", request))
        if request.path:
            return pb.RestoreReply(step=int(request.path.rsplit("/", 1)[1]), fingerprint="fp", path=request.path,
                                   metadata_json=json.dumps(pods[0].metadata))
        step = max(s for s in whole if not request.before_step or s < request.before_step)
        passed = [pb.SkippedCheckpoint(step=s, problems=[pb.PartProblem(directory=f"ckpt/pod-{p}", state=state)
                                                         for p, state in parts.items()])
                  for s, parts in sorted(skipped.items(), reverse=True)
                  if s > step and (not request.before_step or s < request.before_step)]
        return pb.RestoreReply(step=step, fingerprint="fp", path=f"{request.directory}/{step}",
                               metadata_json=json.dumps(pods[0].metadata), skipped=passed)
    pods[0].restore = restore


def _events(tmp_path):
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_resume_takes_the_newest_checkpoint_every_part_holds_and_says_which_it_skipped(tmp_path, capsys):
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1, 2])
    _chooser(pods, whole=[4, 8], skipped={12: {1: pb.PART_STATE_MISSING}, 10: {2: pb.PART_STATE_UNFINISHED}})
    assert checkpointer.resume() == 8
    assert checkpointer.last_good == Saved(8, "ckpt/pod-0/8")
    asked = pods[0].calls[-1][1]
    assert asked.directory == "ckpt/pod-0" and list(asked.parts) == ["ckpt/pod-1", "ckpt/pod-2"]
    assert asked.before_step == 0 and not asked.diloco_directories
    assert [pod.calls[-1][1].path for pod in pods[1:]] == ["ckpt/pod-1/8", "ckpt/pod-2/8"]
    printed = capsys.readouterr().out
    assert "skipping the checkpoint of step 12, it is not whole: pod 1's part is missing" in printed
    assert "skipping the checkpoint of step 10, it is not whole: pod 2's part is unfinished" in printed
    restored = [e for e in _events(tmp_path) if e["event"] == "restored"][-1]
    assert restored["step"] == 8 and restored["skipped"] == [{"step": 12, "parts": {"1": "missing"}},
                                                             {"step": 10, "parts": {"2": "unfinished"}}]


def test_a_part_another_pod_cannot_read_back_sends_the_resume_one_checkpoint_further_back(tmp_path, capsys):
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1])
    _chooser(pods, whole=[4, 8], skipped={})
    restore = pods[1].restore

    def corrupt_at_8(request, timeout_s):
        if request.path == "ckpt/pod-1/8":
            pods[1].calls.append(("Restore", request))
            raise WorkerError("pod 1: Restore failed: DATA_LOSS: checkpoint ckpt/pod-1/8 is corrupt",
                              grpc.StatusCode.DATA_LOSS)
        return restore(request, timeout_s)
    pods[1].restore = corrupt_at_8
    assert checkpointer.resume() == 4
    assert [r.before_step for m, r in pods[0].calls if m == "Restore"] == [0, 8]
    assert [r.path for m, r in pods[1].calls if m == "Restore"] == ["ckpt/pod-1/8", "ckpt/pod-1/4"]
    assert "skipping the checkpoint of step 8, it is not whole: pod 1's part is corrupt" in capsys.readouterr().out
    restored = [e for e in _events(tmp_path) if e["event"] == "restored"][-1]
    assert restored["step"] == 4 and restored["skipped"] == [{"step": 8, "parts": {"1": "corrupt"}}]


def test_a_restore_of_the_last_good_checkpoint_sends_no_parts(tmp_path):
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1])
    checkpointer.last_good = Saved(6, "ckpt/pod-0/6")
    assert checkpointer.restore() == 6
    assert [pod.calls[-1][1].path for pod in pods] == ["ckpt/pod-0/6", "ckpt/pod-1/6"]
    assert not pods[0].calls[-1][1].parts


def _warm_starter(pods):
    """Pod 0 answers a restore from its own folder, which holds no part yet, with the newest
    checkpoint of the warm start's folder (RestoreReply.warm_start); a path restore as asked."""
    def restore(request, timeout_s):
        pods[0].calls.append(("Restore", request))
        path = request.path or f"{request.warm_start_directory}/6"
        return pb.RestoreReply(step=6, fingerprint="fp", path=path, metadata_json=json.dumps(pods[0].metadata),
                               warm_start=not request.path or request.warm_start)
    pods[0].restore = restore


@pytest.mark.parametrize("warm_start_from", ["", "elsewhere/checkpoints"])
def test_a_diloco_resume_with_no_part_saved_warm_starts_every_pod_from_one_every_step_checkpoint(
        tmp_path, capsys, monkeypatch, warm_start_from):
    monkeypatch.chdir(tmp_path)
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1, 2])
    checkpointer.config = dataclasses.replace(checkpointer.config, warm_start_from=warm_start_from)
    _warm_starter(pods)
    assert checkpointer.resume() == 6
    asked = pods[0].calls[-1][1]
    # This run's own directory, or checkpoint.warm_start_from made absolute (the pods may run elsewhere).
    want = str(tmp_path / warm_start_from) if warm_start_from else "ckpt"
    assert asked.directory == "ckpt/pod-0" and asked.warm_start_directory == want
    # The others restore the very checkpoint pod 0 chose, as a warm start.
    assert [(p.calls[-1][1].path, p.calls[-1][1].warm_start) for p in pods[1:]] == [(f"{want}/6", True)] * 2
    # Not a checkpoint of this run: the first step boundary saves its baseline, and a rewind needs one.
    assert checkpointer.last_good is None and checkpointer.due(6)
    assert "DiLoCo warm start: every pod took the every-step checkpoint" in capsys.readouterr().out
    restored = [e for e in _events(tmp_path) if e["event"] == "restored"][-1]
    assert restored["step"] == 6 and restored["warm_start"] is True and restored["path"] == f"{want}/6"


def test_a_resume_with_fewer_pods_than_saved_the_checkpoint_says_whose_parts_it_leaves_out(
        tmp_path, capsys, monkeypatch):
    """A DiLoCo checkpoint 3 pods wrote, resumed by 2: pods 0 and 1 take their own parts, and the
    third pod's part, with its inner steps, is named as left out (on the console and in the
    restored event); a part of an older step only is not counted."""
    monkeypatch.chdir(tmp_path)         # the checkpointer's directory is "ckpt"
    for part in ("pod-0/8", "pod-1/8", "pod-2/8", "pod-3/4"):
        (tmp_path / "ckpt" / part).mkdir(parents=True)
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1])
    _chooser(pods, whole=[8], skipped={})
    assert checkpointer.resume() == 8
    printed = capsys.readouterr().out
    assert "holds parts of more pods than this run's 2: pods 0-1 go on from their own parts; pod 2's part is " \
           "left out, with the steps it took since its last outer step" in printed
    assert [e for e in _events(tmp_path) if e["event"] == "restored"][-1]["parts_left_out"] == [2]

    (tmp_path / "ckpt" / "pod-2" / "8").rmdir()         # as many parts as pods: nothing to say
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1])
    _chooser(pods, whole=[8], skipped={})
    assert checkpointer.resume() == 8
    assert "left out" not in capsys.readouterr().out
    assert "parts_left_out" not in [e for e in _events(tmp_path) if e["event"] == "restored"][-1]
