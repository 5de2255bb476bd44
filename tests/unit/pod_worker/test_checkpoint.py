"""Checkpoints through a real worker (in this process): background saves, keep-last-k, what a
checkpoint holds, and clear errors for corrupt, incompatible, missing and failed checkpoints."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import shutil

import grpc
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from multipod.pod_worker import checkpoint
from multipod.pod_worker.checkpoint_writer import Writer
from multipod.pod_worker.schema import LrSchedule, SyncConfig
from multipod.pod_worker.trainer import PodTrainer
from multipod.protos import codec, multipod_pb2 as pb
from tests.helpers import tiny_worker_config
from tests.unit.pod_worker.in_process_worker import InProcessWorker, module_worker

CONFIG = tiny_worker_config()
ROWS, COLS = CONFIG.train.global_batch, CONFIG.train.seq_len + 1


class Worker(InProcessWorker):
    @property
    def step(self) -> int:
        return self.stub.Status(pb.StatusRequest(), timeout=10).step

    def train(self) -> pb.StepReply:
        step = self.step
        tokens = np.random.default_rng(step).integers(0, 256, (ROWS, COLS), dtype=np.int32)
        return self.stub.Step(pb.StepRequest(step=step, tokens=codec.encode(tokens),
                                             global_tokens=ROWS * (COLS - 1), run_id=self.pod.setup().run_id),
                              timeout=60)

    def save(self, directory, keep=0, meta=None) -> pb.SaveReply:
        """Background save, then wait for it: the controller's protocol."""
        step = self.step
        reply = self.stub.Save(pb.SaveRequest(step=step, directory=str(directory), background=True, keep=keep,
                                              metadata_json=json.dumps(meta or {"data_position": step})), timeout=60)
        assert reply.pending
        self.stub.WaitSave(pb.WaitSaveRequest(step=step, directory=str(directory)), timeout=120)
        return reply

    def fingerprint(self) -> str:
        return self.service.pod.trainer.fingerprint()


worker = module_worker(lambda: Worker(CONFIG, "checkpoint-test"))


def test_background_save_lets_the_pod_step_on_and_holds_the_state_it_was_asked_for(worker, tmp_path):
    worker.train()
    step = worker.step
    reply = worker.stub.Save(pb.SaveRequest(step=step, directory=str(tmp_path), background=True,
                                            metadata_json=json.dumps({"data_position": step})), timeout=60)
    assert reply.pending and reply.fingerprint == worker.fingerprint()
    worker.train()                  # the pod steps while the checkpoint is being written
    after = worker.fingerprint()
    done = worker.stub.WaitSave(pb.WaitSaveRequest(step=step, directory=str(tmp_path)), timeout=120)
    assert pathlib.Path(done.path) == tmp_path / str(step)
    restored = worker.stub.Restore(pb.RestoreRequest(path=done.path), timeout=120)
    assert restored.step == step and restored.fingerprint == reply.fingerprint != after
    assert worker.fingerprint() == restored.fingerprint     # the state loaded is the one verified
    meta = json.loads(restored.metadata_json)
    # Parameters + optimizer state (the fingerprint covers both), step, data position, config.
    assert meta["step"] == step and meta["data_position"] == step and meta["fingerprint"] == reply.fingerprint
    assert meta["worker_config"] == CONFIG.to_dict() and meta["state_key"] == CONFIG.state_key()


def test_keeps_the_last_k(worker, tmp_path):
    steps = []
    for _ in range(4):
        worker.train()
        steps.append(worker.step)
        worker.save(tmp_path, keep=2)
    assert checkpoint.steps(str(tmp_path)) == steps[-2:]
    assert checkpoint.latest(str(tmp_path)) == tmp_path / str(steps[-1])
    restored = worker.stub.Restore(pb.RestoreRequest(directory=str(tmp_path)), timeout=120)
    assert restored.step == steps[-1] and restored.path == str(tmp_path / str(steps[-1]))


def _restore_error(worker, **request) -> grpc.RpcError:
    before = worker.fingerprint()
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Restore(pb.RestoreRequest(**request), timeout=120)
    assert worker.fingerprint() == before          # a refused restore changes nothing
    return info.value


def test_corrupt_checkpoint_gets_a_clear_error(worker, tmp_path):
    worker.save(tmp_path / "good")
    step = worker.step
    rng = np.random.default_rng(0)
    # Garbage in every array file: the reader fails, or the bytes read back do not match.
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "good", bad)
    for f in (bad / str(step) / "state").rglob("*"):
        if f.is_file() and f.name not in ("_METADATA", "commit_success.txt", "_sharding"):
            f.write_bytes(rng.bytes(f.stat().st_size))
    error = _restore_error(worker, path=str(bad / str(step)))
    assert error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS)
    assert str(bad / str(step)) in error.details() and "corrupt" in error.details()
    assert len(error.details()) < 1000, error.details()     # the gist, not kilobytes of reader internals
    # Garbage metadata.
    meta = tmp_path / "meta"
    shutil.copytree(tmp_path / "good", meta)
    (meta / str(step) / "meta" / "metadata").write_bytes(b"\x00{not json")
    error = _restore_error(worker, path=str(meta / str(step)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "corrupt" in error.details()
    # The worker is unharmed and still trains.
    assert worker.train().checksum


def test_incompatible_checkpoint_names_what_does_not_match(worker, tmp_path):
    other = dataclasses.replace(CONFIG, model=dataclasses.replace(CONFIG.model, d_model=64),
                                train=dataclasses.replace(CONFIG.train, seed=3, total_steps=99))
    state = worker.service.pod.trainer.host_state()
    checkpoint.save(str(tmp_path), state, worker.fingerprint(), json.dumps({"state_key": other.state_key()}))
    error = _restore_error(worker, path=str(tmp_path / str(state["step"])))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "model.d_model: checkpoint has 64, this run has 32" in error.details()
    assert "seed: checkpoint has 3, this run has 0" in error.details()
    assert "schedule_steps: checkpoint has 99, this run has 20" in error.details()
    assert "to train on past the saved run's end, keep its schedule: --set optimizer.decay_steps=99" in error.details()


def _with(config, total_steps: int, decay_steps: int = 0, **sync):
    optimizer = dataclasses.replace(config.optimizer, decay_steps=decay_steps)
    return dataclasses.replace(config, optimizer=optimizer, train=dataclasses.replace(config.train,
                                                                                      total_steps=total_steps), **sync)


def test_a_finished_run_trains_on_past_its_end_with_its_schedule_kept():
    """The state key holds the schedule as it runs: a run of 20 steps decaying over its steps has
    the schedule of one of 30 steps decaying over 20, and a checkpoint of the first resumes in the
    second; the hint the refusal gives (optimizer.decay_steps = the saved schedule) is that run."""
    saved = {"state_key": _with(CONFIG, 20).state_key()}
    checkpoint.check_compatible("c/20", saved, _with(CONFIG, 30, decay_steps=20).state_key())
    with pytest.raises(checkpoint.CheckpointError, match=r"schedule_steps: checkpoint has 20, this run has 30 .*"
                                                         r"optimizer\.decay_steps=20\)$"):
        checkpoint.check_compatible("c/20", saved, _with(CONFIG, 30).state_key())
    # An earlier version's key, which held the raw optimizer.decay_steps (and DiLoCo's memory
    # budget), still resumes.
    legacy = json.loads(json.dumps(saved))
    legacy["state_key"]["optimizer"]["decay_steps"] = 0
    checkpoint.check_compatible("c/20", legacy, _with(CONFIG, 30, decay_steps=20).state_key())
    # DiLoCo: the replay's memory budget changes no value; the outer step's settings do.
    diloco = SyncConfig(mode="diloco", inner_steps=4)
    saved = {"state_key": _with(CONFIG, 20, sync=diloco).state_key()}
    bigger = dataclasses.replace(diloco, replay_history_mb=4096)
    checkpoint.check_compatible("c/20", saved, _with(CONFIG, 20, sync=bigger).state_key())
    with pytest.raises(checkpoint.CheckpointError, match="sync.outer_lr: checkpoint has 0.7, this run has 0.5"):
        checkpoint.check_compatible("c/20", saved, _with(CONFIG, 20, sync=dataclasses.replace(diloco, outer_lr=0.5))
                                    .state_key())


def _wsd(config, total_steps: int, decay_fraction: float = 0.2):
    optimizer = dataclasses.replace(config.optimizer, schedule=LrSchedule.WSD, decay_fraction=decay_fraction)
    return dataclasses.replace(_with(config, total_steps), optimizer=optimizer)


def test_a_wsd_run_resumes_with_another_length_from_its_stable_phase():
    """warmup-stable-decay: a checkpoint taken before both schedules' decays ran at the rates of
    either (test_optimizer.py), so a run of 100 steps resumes a 20-step run's step 16 (its decay
    starts at 16) and a shorter or differently decaying run too; a step inside a decay is
    refused saying whose decay and what to change; cosine and wsd never stand in for each other,
    and a cosine run's key is what it was before wsd existed (old checkpoints still resume)."""
    short = {"state_key": _wsd(CONFIG, 20).state_key(), "step": 16}
    checkpoint.check_compatible("c/16", short, _wsd(CONFIG, 100).state_key())
    checkpoint.check_compatible("c/16", short, _wsd(CONFIG, 100, decay_fraction=0.5).state_key())
    checkpoint.check_compatible("c/16", short, _wsd(CONFIG, 20).state_key())
    with pytest.raises(checkpoint.CheckpointError, match=r"step 17 is past the start of its own wsd decay \(step 16\)"):
        checkpoint.check_compatible("c/17", {**short, "step": 17}, _wsd(CONFIG, 100).state_key())
    checkpoint.check_compatible("c/17", {**short, "step": 17}, _wsd(CONFIG, 20).state_key())    # the same schedule
    with pytest.raises(checkpoint.CheckpointError, match=r"this run's wsd decay starts at step 12, before the "
                                                         r"checkpoint's step 16: lengthen the run"):
        checkpoint.check_compatible("c/16", short, _wsd(CONFIG, 15).state_key())
    # The peak and the warmup are the rates of every step: they must match.
    other_peak = dataclasses.replace(_wsd(CONFIG, 100), optimizer=dataclasses.replace(
        _wsd(CONFIG, 100).optimizer, learning_rate=0.5))
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.learning_rate"):
        checkpoint.check_compatible("c/16", short, other_peak.state_key())
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.schedule: checkpoint has 'wsd', this run has "
                                                         "'cosine'"):
        checkpoint.check_compatible("c/16", short, _with(CONFIG, 100).state_key())
    cosine = {"state_key": _with(CONFIG, 20).state_key(), "step": 16}
    assert "schedule" not in cosine["state_key"]["optimizer"]
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.schedule: checkpoint has 'cosine', this run has "
                                                         "'wsd'"):
        checkpoint.check_compatible("c/16", cosine, _wsd(CONFIG, 20).state_key())


def test_missing_checkpoint_gets_a_clear_error(worker, tmp_path):
    error = _restore_error(worker, directory=str(tmp_path / "empty"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "no checkpoint to resume from" in error.details()
    error = _restore_error(worker, path=str(tmp_path / "nothing" / "7"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "no checkpoint at" in error.details()


def test_failed_save_is_reported_and_never_replaces_the_last_good_one(worker, tmp_path, monkeypatch):
    worker.train()
    worker.save(tmp_path)
    good = checkpoint.latest(str(tmp_path))
    worker.train()

    async def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    # The metadata write fails in orbax's background thread, after Save has returned.
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", disk_full)
    step = worker.step
    reply = worker.stub.Save(pb.SaveRequest(step=step, directory=str(tmp_path), background=True), timeout=60)
    assert reply.pending
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.WaitSave(pb.WaitSaveRequest(step=step, directory=str(tmp_path)), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"checkpoint of step {step}" in info.value.details() and "No space left" in info.value.details()
    assert checkpoint.latest(str(tmp_path)) == good
    monkeypatch.undo()
    assert worker.stub.Restore(pb.RestoreRequest(directory=str(tmp_path)), timeout=120).path == str(good)
    worker.train()
    worker.save(tmp_path)            # the next save under the same root works
    assert checkpoint.latest(str(tmp_path)) == tmp_path / str(worker.step)


def test_a_save_after_a_failed_one_works_whichever_thread_asks(tmp_path, monkeypatch):
    writer = Writer()

    def in_thread(fn, *args):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:     # a fresh thread per call
            return pool.submit(fn, *args).result()

    async def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", disk_full)
    in_thread(writer.submit, str(tmp_path), {"x": np.arange(3.0), "step": 1}, "fp1", "{}", 2)
    with pytest.raises(checkpoint.CheckpointError, match="No space left"):
        in_thread(writer.wait, str(tmp_path), 1, 60)
    monkeypatch.undo()
    for step in (2, 3):
        in_thread(writer.submit, str(tmp_path), {"x": np.arange(3.0) * step, "step": step}, f"fp{step}", "{}", 2)
        assert in_thread(writer.wait, str(tmp_path), step, 60) == tmp_path / str(step)
    assert checkpoint.steps(str(tmp_path)) == [2, 3]
    assert checkpoint.read_metadata(str(tmp_path / "3"))["fingerprint"] == "fp3"
    writer.close()


def test_a_step_saved_again_replaces_the_earlier_timeline_s(tmp_path):
    """A run resumed from an older checkpoint (a newer one was not whole) saves that newer step
    again: the new save replaces the folder left by the timeline the run abandoned."""
    for fingerprint in ("abandoned", "resumed"):
        writer = Writer()     # each run its own writer, as a restarted worker
        writer.submit(str(tmp_path), {"x": np.arange(3.0), "step": 5}, fingerprint, "{}", 2)
        assert writer.wait(str(tmp_path), 5, 60) == tmp_path / "5"
        writer.close()
    assert checkpoint.steps(str(tmp_path)) == [5]
    assert checkpoint.read_metadata(str(tmp_path / "5"))["fingerprint"] == "resumed"


def test_two_writers_taking_turns_in_one_directory_keep_the_newest_k(tmp_path):
    """DiLoCo: a survivor writes a failed pod's parts into that pod's directory, then the pod (back,
    its own writer still open) writes there again, then the survivor once more: each writer reads
    what the other wrote, so the directory keeps exactly the newest `keep`."""
    pod, survivor = Writer(), Writer()

    def save(writer, step):
        writer.submit(str(tmp_path), {"x": np.arange(3.0) * step, "step": step}, f"fp{step}", "{}", 2)
        writer.wait(str(tmp_path), step, 60)
    try:
        for writer, step in [(pod, 0), (pod, 8), (survivor, 16), (survivor, 24), (pod, 32), (survivor, 40)]:
            save(writer, step)
            assert checkpoint.steps(str(tmp_path)) == sorted({0, 8, 16, 24, 32, 40} & set(range(step - 15, step + 1)))
    finally:
        pod.close()
        survivor.close()


def test_save_of_the_wrong_step_is_refused(worker, tmp_path):
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Save(pb.SaveRequest(step=worker.step + 5, directory=str(tmp_path)), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "save requested for step" in info.value.details()


def test_a_save_of_another_slot_s_part_is_refused_outside_diloco_naming_why(worker, tmp_path):
    """SaveRequest.slot (a failed slot's part, written on its behalf) means something in DiLoCo mode
    only: an every-step pod refuses it over the wire, and writes nothing."""
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Save(pb.SaveRequest(step=worker.step, directory=str(tmp_path), slot=1), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only a DiLoCo pod" in info.value.details() and "slot 1" in info.value.details()
    assert checkpoint.steps(str(tmp_path)) == []


def _trained(config, devices) -> PodTrainer:
    """A trainer over `devices` whose state is not the initial one (one update)."""
    trainer = PodTrainer(config, devices=devices)
    grads = jax.tree.map(lambda p: jax.numpy.full_like(p, 0.01), trainer.params)
    trainer.apply(jax.tree.leaves(grads))
    return trainer


def test_a_checkpoint_restores_onto_another_device_count(tmp_path):
    one = _trained(CONFIG, jax.devices()[:1])
    saved = one.fingerprint()
    checkpoint.save(str(tmp_path), {"params": one.params, "opt_state": one.opt_state, "step": one.step}, saved,
                    json.dumps({}))
    # Two devices with the model axis across them: every host reads the shards its devices need.
    two = PodTrainer(dataclasses.replace(CONFIG, mesh=dataclasses.replace(CONFIG.mesh, model=2)),
                     devices=jax.devices()[:2])
    target = {"params": two.params, "opt_state": two.opt_state, "step": 0}
    state, meta = checkpoint.restore(str(tmp_path / "1"), target)
    assert meta["fingerprint"] == saved and state["step"] == 1
    for have, want in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        if isinstance(want, jax.Array):
            assert have.sharding == want.sharding and len(have.sharding.device_set) == 2
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state["params"]))
    two.load_state(state["params"], state["opt_state"], state["step"])
    assert two.fingerprint() == saved       # bitwise the state saved from one device


def test_a_checkpoint_of_other_shapes_is_refused_naming_the_leaf(tmp_path):
    one = _trained(CONFIG, jax.devices()[:1])
    checkpoint.save(str(tmp_path), {"params": one.params, "opt_state": one.opt_state, "step": one.step},
                    one.fingerprint(), json.dumps({}))
    wide = PodTrainer(dataclasses.replace(CONFIG, model=dataclasses.replace(CONFIG.model, mlp_dim=128)),
                      devices=jax.devices()[:1])
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.restore(str(tmp_path / "1"), {"params": wide.params, "opt_state": wide.opt_state, "step": 0})
    message = str(info.value)
    assert str(tmp_path / "1") in message and "does not fit this pod's state" in message
    assert "checkpoint has shape (32, 64), this pod has (32, 128)" in message, message
    assert "params." in message and len(message) < 2000


def test_replicated_arrays_are_split_between_replicas_only_when_large(tmp_path, caplog):
    # Orbax's replica-parallel save slices each replicated array between its replicas, a compiled
    # slice program per shape and device: under MIN_REPLICA_PARALLEL_SLICE_BYTES a part is not
    # worth one. Shapes of this test's own, so no earlier test compiled their slices.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    large = checkpoint.MIN_REPLICA_PARALLEL_SLICE_BYTES // 4 * 2 + 4 * 3   # float32: 2 parts at the bound
    host = {"small": np.arange(6 * 37, dtype=np.float32).reshape(6, 37),
            "large": np.linspace(0, 1, large, dtype=np.float32).reshape(2, large // 2)}
    state = {"params": jax.device_put(host, replicated), "step": 1}
    with jax.log_compiles(), caplog.at_level("WARNING", logger="jax._src.interpreters.pxla"):
        checkpoint.save(str(tmp_path), state, "f", json.dumps({}))
    sliced = {record.getMessage().split("ShapedArray(")[1].split(")")[0] for record in caplog.records
              if record.getMessage().startswith("Compiling jit(slice)")}
    assert sliced == {f"float32[2,{large // 2}]"}
    restored, _ = checkpoint.restore(str(tmp_path / "1"), state)
    for name, value in host.items():
        assert np.array_equal(np.asarray(restored["params"][name]), value)
