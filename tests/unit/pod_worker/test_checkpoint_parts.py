"""A restore from a directory takes the newest checkpoint every part holds whole (RestoreRequest.parts,
checkpoint_parts.newest_whole), through a real worker in this process: a part that is missing, only
orbax's temporary folder (a write that never completed), unreadable, or whose arrays do not read
back is passed over, each named with its PartState in RestoreReply.skipped; with none whole the
restore is refused naming why and changes nothing. An every-step resume refuses to go back past a
newer checkpoint in a DiLoCo run's folders (RestoreRequest.diloco_directories)."""
from __future__ import annotations

import shutil

import grpc
import jax
import numpy as np
import pytest

from multipod.pod_worker import checkpoint
from multipod.pod_worker.trainer import PodTrainer
from multipod.protos import multipod_pb2 as pb
from tests.unit.pod_worker.in_process_worker import module_worker
from tests.unit.pod_worker.test_checkpoint import CONFIG, Worker

worker = module_worker(lambda: Worker(CONFIG, "checkpoint-parts-test"))


def _skipped(reply: pb.RestoreReply) -> list[tuple[int, list[tuple[str, int]]]]:
    return [(s.step, [(p.directory, p.state) for p in s.problems]) for s in reply.skipped]


def test_a_resume_takes_the_newest_step_every_part_holds_whole_and_names_the_ones_it_skips(worker, tmp_path):
    own, missing, unfinished = tmp_path / "pod-0", tmp_path / "pod-1", tmp_path / "pod-2"
    steps, prints = [], {}
    for _ in range(3):
        worker.train()
        steps.append(worker.step)
        prints[worker.step] = worker.save(own).fingerprint
    first, second, third = steps
    shutil.copytree(own, missing)
    shutil.rmtree(missing / str(third))                 # pod 1's save of the newest step failed
    shutil.copytree(own, unfinished)                    # pod 2's write of the middle one was cut short
    (unfinished / str(second)).rename(unfinished / f"{second}.orbax-checkpoint-tmp-1700000000")
    assert checkpoint.steps(str(unfinished)) == [first, third]

    worker.train()
    reply = worker.stub.Restore(pb.RestoreRequest(directory=str(own), parts=[str(missing), str(unfinished)]),
                                timeout=120)
    assert reply.step == first and reply.path == str(own / str(first)) and reply.fingerprint == prints[first]
    assert _skipped(reply) == [(third, [(str(missing), pb.PART_STATE_MISSING)]),
                               (second, [(str(unfinished), pb.PART_STATE_UNFINISHED)])]
    # Alone, the directory's newest; before_step looks further back.
    assert worker.stub.Restore(pb.RestoreRequest(directory=str(own)), timeout=120).step == third
    older = worker.stub.Restore(pb.RestoreRequest(directory=str(own), before_step=third), timeout=120)
    assert older.step == second and not older.skipped
    # An every-step resume does not go back past a newer checkpoint in a DiLoCo run's folders.
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Restore(pb.RestoreRequest(directory=str(missing), diloco_directories=[str(own)]), timeout=120)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"DiLoCo run saved a checkpoint of step {third} in {own}" in info.value.details()
    assert worker.stub.Restore(pb.RestoreRequest(directory=str(own), diloco_directories=[str(unfinished)]),
                               timeout=120).step == third

    # Metadata that does not read: unreadable; with no step whole the restore is refused naming why.
    (missing / str(first) / "meta" / "metadata").write_bytes(b"\x00{not json")
    before = worker.fingerprint()
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Restore(pb.RestoreRequest(directory=str(own), parts=[str(missing), str(unfinished)]), timeout=120)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no whole checkpoint" in info.value.details() and "PART_STATE_UNREADABLE" in info.value.details()
    assert worker.fingerprint() == before
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Restore(pb.RestoreRequest(path=str(own / str(first)), parts=[str(missing)]), timeout=120)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parts" in info.value.details()
    for bad in ({"path": str(own / str(first)), "diloco_directories": [str(missing)]},
                {"directory": str(own), "diloco_directories": [""]}):
        with pytest.raises(grpc.RpcError) as info:
            worker.stub.Restore(pb.RestoreRequest(**bad), timeout=120)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "diloco_directories" in info.value.details()
    assert worker.fingerprint() == before


def test_a_part_whose_arrays_do_not_read_back_is_skipped_for_the_one_before(worker, tmp_path):
    saved = []
    for _ in range(2):
        worker.train()
        saved.append((worker.step, worker.save(tmp_path).fingerprint))
    rng = np.random.default_rng(0)
    for f in (tmp_path / str(saved[1][0]) / "state").rglob("*"):   # garbage in the newest one's arrays
        if f.is_file() and f.name not in ("_METADATA", "commit_success.txt", "_sharding"):
            f.write_bytes(rng.bytes(f.stat().st_size))
    reply = worker.stub.Restore(pb.RestoreRequest(directory=str(tmp_path)), timeout=120)
    assert (reply.step, reply.fingerprint) == saved[0]
    assert _skipped(reply) == [(saved[1][0], [(str(tmp_path), pb.PART_STATE_CORRUPT)])]
    assert "corrupt" in reply.skipped[0].problems[0].detail
    assert worker.train().checksum


def test_parts_with_no_checkpoint_at_all_are_named_as_a_run_of_another_number_of_pods(tmp_path):
    """A DiLoCo run of 2 pods resumed with 4: pods 2 and 3 have no part of any checkpoint."""
    from multipod.pod_worker.checkpoint import CheckpointError
    from multipod.pod_worker.checkpoint_parts import newest_whole
    trainer = PodTrainer(CONFIG, devices=jax.devices()[:1])
    for pod in (0, 1):
        checkpoint.save(str(tmp_path / f"pod-{pod}"), trainer.host_state(), trainer.fingerprint(), "{}")
    parts = [str(tmp_path / f"pod-{pod}") for pod in (1, 2, 3)]
    with pytest.raises(CheckpointError) as info:
        newest_whole(str(tmp_path / "pod-0"), parts)
    assert f"step 0: {parts[1]} PART_STATE_MISSING, {parts[2]} PART_STATE_MISSING" in str(info.value)
    assert f"({parts[1]}, {parts[2]} hold no checkpoint at all: if a run of fewer pods saved these" in str(info.value)
    assert newest_whole(str(tmp_path / "pod-0"), parts[:1]).step == 0     # the 2 pods' own parts are whole
