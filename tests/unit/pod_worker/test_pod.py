"""A pod through its gRPC adapter, in this process: the worker's own waits answer with typed codes
(never DEADLINE_EXCEEDED), Status reports the sequencer's state, and a failed step leaves the
state as it was until a restore brings the pod back to READY."""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from multipod.protos import codec, multipod_pb2 as pb
from tests.helpers import tiny_worker_config
from tests.unit.pod_worker.in_process_worker import InProcessWorker, module_worker

CONFIG = tiny_worker_config()
ROWS, COLS = CONFIG.train.global_batch, CONFIG.train.seq_len + 1


class Worker(InProcessWorker):
    def status(self) -> pb.StatusReply:
        return self.stub.Status(pb.StatusRequest(), timeout=10)

    def step_request(self, step: int) -> pb.StepRequest:
        tokens = np.random.default_rng(step).integers(0, 256, (ROWS, COLS), dtype=np.int32)
        return pb.StepRequest(step=step, tokens=codec.encode(tokens), global_tokens=ROWS * (COLS - 1),
                              run_id=self.pod.setup().run_id)     # the timeline the pod is on, as the controller's

    def train(self) -> pb.StepReply:
        return self.stub.Step(self.step_request(self.status().step), timeout=60)


worker = module_worker(lambda: Worker(CONFIG, "pod-test"))


def _error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def test_status_reports_ready_after_configure(worker):
    status = worker.status()
    assert status.configured and status.state == pb.WORKER_STATE_READY


def test_a_step_whose_predecessor_never_comes_is_aborted_before_the_rpc_deadline(worker):
    ahead = worker.status().step + 1
    start = time.monotonic()
    # Deadlines of 5 s or more leave the worker its whole answer margin (rpc_handler.wait_budget:
    # 0.5 s), which a loaded machine needs; a shorter one leaves a tenth of it.
    error = _error(worker.stub.Step, worker.step_request(ahead), timeout=5.0)
    assert error.code() == grpc.StatusCode.ABORTED, error.details()
    assert "did not finish in time" in error.details() and time.monotonic() - start < 5.0
    assert worker.train().checksum             # the pod steps on


def test_save_and_restore_while_the_pod_is_busy_say_failed_precondition(worker, tmp_path):
    step = worker.status().step
    worker.stub.Save(pb.SaveRequest(step=step, directory=str(tmp_path)), timeout=120)   # one to restore
    held, release = threading.Event(), threading.Event()

    def hold():   # stands in for a long step: the pod is taken until released
        with worker.pod.seq.hold("a long step", time.monotonic() + 30):
            held.set()
            release.wait(30)
    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        error = _error(worker.stub.Save, pb.SaveRequest(step=step, directory=str(tmp_path)), timeout=5)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "still running" in error.details()
        error = _error(worker.stub.Restore, pb.RestoreRequest(directory=str(tmp_path)), timeout=5)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "still running" in error.details()
        assert worker.status().state == pb.WORKER_STATE_READY    # a hold without a state of its own
    finally:
        release.set()
        thread.join(10)


def test_wait_save_of_a_save_never_started_is_not_found(worker, tmp_path):
    error = _error(worker.stub.WaitSave, pb.WaitSaveRequest(step=12345, directory=str(tmp_path)), timeout=10)
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_a_failed_step_keeps_the_state_and_a_restore_makes_the_pod_ready_again(worker, tmp_path, monkeypatch):
    step = worker.status().step
    worker.stub.Save(pb.SaveRequest(step=step, directory=str(tmp_path)), timeout=120)   # synchronous
    before = worker.pod.trainer.fingerprint()

    def broken_update(*args, **kwargs):
        raise RuntimeError("the update broke")
    monkeypatch.setattr(worker.pod.trainer, "apply", broken_update)
    error = _error(worker.stub.Step, worker.step_request(step), timeout=60)
    assert error.code() == grpc.StatusCode.INTERNAL and "update broke" in error.details()
    monkeypatch.undo()
    status = worker.status()
    assert status.state == pb.WORKER_STATE_FAILED and status.step == step
    assert worker.pod.trainer.fingerprint() == before
    error = _error(worker.stub.Step, worker.step_request(step + 1), timeout=30)
    assert error.code() == grpc.StatusCode.ABORTED and f"step {step} failed" in error.details()
    restored = worker.stub.Restore(pb.RestoreRequest(directory=str(tmp_path), run_id="pod-test-2"), timeout=120)
    assert restored.step == step and restored.fingerprint == before
    assert worker.status().state == pb.WORKER_STATE_READY
    assert worker.train().step == step
    assert worker.status().step == step + 1


def test_a_step_sent_for_another_timeline_is_refused_and_changes_nothing(worker, tmp_path):
    """A request the controller sent before a restore (or a membership change) and that reaches
    the pod after it is refused with ABORTED, not run on the new timeline; the pod's own steps go on."""
    step = worker.status().step
    worker.stub.Save(pb.SaveRequest(step=step, directory=str(tmp_path)), timeout=120)
    stale = worker.step_request(step)                  # sent under the pod's current run id ...
    worker.stub.Restore(pb.RestoreRequest(directory=str(tmp_path), run_id="after-restore"), timeout=120)
    before = worker.pod.trainer.fingerprint()
    error = _error(worker.stub.Step, stale, timeout=30)     # ... delivered after the restore
    assert error.code() == grpc.StatusCode.ABORTED, error.details()
    assert "after-restore" in error.details() and stale.run_id in error.details()
    status = worker.status()
    assert status.step == step and status.state == pb.WORKER_STATE_READY
    assert worker.pod.trainer.fingerprint() == before
    assert worker.train().step == step                 # the same step, under the new run id
    error = _error(worker.stub.Step, pb.StepRequest(step=step + 1, tokens=stale.tokens, global_tokens=1), timeout=30)
    assert error.code() == grpc.StatusCode.ABORTED and "(none)" in error.details()
