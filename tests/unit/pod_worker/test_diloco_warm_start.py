"""A DiLoCo run warm-started from an every-step checkpoint (RestoreRequest.warm_start), in process:
the DiLoCo paper starts its workers from a data-parallel model, and a user gets that by resuming
an every-step run's checkpoint with sync.mode = "diloco".

  - every pod restores the same every-step state; the agreed values start as its parameters and
    the outer optimizer afresh, the pods are bitwise alike in the agreed state after each outer
    step that follows, and one pod at H=1 with plain outer SGD at lr 1 goes on exactly like the
    every-step run it was taken from (to float tolerance);
  - a restore from the pods' own folders takes a DiLoCo checkpoint once one exists, and the
    every-step one only while none does;
  - a warm start refuses a DiLoCo checkpoint, and a pod that syncs every step refuses it;
  - an every-step resume refuses to go back past a newer checkpoint of a DiLoCo run in the same
    directory, and changes nothing.
"""
from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time

import jax
import numpy as np
import pytest

from multipod.pod_worker import checkpoint
from multipod.pod_worker.checkpoint import CheckpointError
from multipod.pod_worker.errors import InvalidRequest
from multipod.pod_worker.schema import SyncConfig
from multipod.pod_worker.trainer import fingerprint
from tests.helpers import tiny_worker_config
from tests.unit.pod_worker.test_diloco import COLS, DEADLINE_S, ROWS, Pods, _config, _runs, tokens
from tests.unit.pod_worker.test_rejoin import Call

WARM_AT = 3


def _deadline() -> float:
    return time.monotonic() + DEADLINE_S


def _every_step(pods: int):
    base = tiny_worker_config()
    return dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=pods * ROWS)).validate()


def _save(pod, step: int, directory) -> str:
    pod.start_save(step, str(directory), {}, 0, _deadline())
    return str(pod.wait_save(str(directory), step, DEADLINE_S))


def _every_step_checkpoint(tmp_path, pods: int, steps: int) -> tuple[str, list]:
    """An every-step run of `pods` pods: pod 0's checkpoint after WARM_AT steps, and the
    parameters (on the host) after `steps` steps."""
    run = Pods(_every_step(pods), pods)
    try:
        path = ""
        for step in range(steps):
            if step == WARM_AT:
                path = _save(run.pods[0], step, tmp_path / "every-step")
            # Each pod's loss is normalised by the whole batch's targets, as the controller asks.
            calls = [Call(pod.step, pod.setup(), step, tokens(step, pod.pod_index), pods * ROWS * (COLS - 1),
                          _deadline(), lambda: True) for pod in run.pods]
            assert not any(call.result()[0].skipped for call in calls)
        return path, [np.asarray(leaf) for leaf in jax.tree.leaves(run.pods[0].trainer.params)]
    finally:
        run.close()


def test_pods_warm_started_from_an_every_step_checkpoint_start_their_agreed_state_there(tmp_path):
    path, _ = _every_step_checkpoint(tmp_path, 2, WARM_AT + 1)
    saved = checkpoint.read_metadata(path)
    assert "outer" not in saved
    pods = Pods(_config(2, inner_steps=4, fragments=2, overlap_steps=1, outer_dtype="int4"), 2)
    try:
        run_id = f"warm-{next(_runs)}"
        restored = [pod.restore(path, None, run_id, _deadline(), warm_start=True) for pod in pods.pods]
        assert all(r.warm_start and r.step == WARM_AT for r in restored)
        assert len({r.fingerprint for r in restored}) == 1
        for pod in pods.pods:
            trainer = pod.trainer
            # The agreed values are the checkpoint's parameters, and so are the pod's own.
            assert fingerprint(trainer.outer.agreed) == fingerprint(jax.tree.leaves(trainer.params))
            assert fingerprint(trainer.params, trainer.opt_state) == saved["fingerprint"]
            assert trainer.outer.applied == WARM_AT // 2 and trainer.outer.pending is None
        outer = {}
        for step in range(WARM_AT, WARM_AT + 6):
            outcomes = pods.step(step)
            assert len({o.checksum for o in outcomes}) == 1, f"step {step}: the agreed state differs"
            if outcomes[0].outer is not None:
                outer[step] = (outcomes[0].outer.sync, outcomes[0].outer.fragment)
        # The cycle goes on from 3 inner steps: sync n starts after 2n of them and applies one step
        # later (sync 2, after inner step 4, in the record of step 4, counted from 0).
        assert outer == {4: (2, 1), 6: (3, 0), 8: (4, 1)}

        # The pods' own folders hold no DiLoCo checkpoint: a restore from them takes the every-step one.
        parts = [str(tmp_path / "diloco" / f"pod-{k}") for k in (0, 1)]
        with pytest.raises(CheckpointError, match="nor an every-step one in .*empty to warm-start from"):
            pods.pods[0].restore(None, parts[0], f"warm-{next(_runs)}", _deadline(), parts=(parts[1],),
                                 warm_start_directory=str(tmp_path / "empty"))
        run_id = f"warm-{next(_runs)}"
        again = [pod.restore(None, parts[k], run_id, _deadline(), parts=(parts[1 - k],),
                             warm_start_directory=str(tmp_path / "every-step")) for k, pod in enumerate(pods.pods)]
        assert all(r.warm_start and r.path == path for r in again)
        # Once they hold one, a restore takes it as it is.
        for pod, part in zip(pods.pods, parts):
            _save(pod, WARM_AT, part)
        own = pods.pods[0].restore(None, parts[0], f"warm-{next(_runs)}", _deadline(), parts=(parts[1],),
                                   warm_start_directory=str(tmp_path / "every-step"))
        assert not own.warm_start and own.path == str((pathlib.Path(parts[0]) / str(WARM_AT)).absolute())

        # A warm start takes an every-step checkpoint, not a DiLoCo one.
        with pytest.raises(CheckpointError, match="holds a DiLoCo outer state"):
            pods.pods[0].restore(own.path, None, f"warm-{next(_runs)}", _deadline(), warm_start=True)
    finally:
        pods.close()


def test_one_pod_at_h1_warm_started_goes_on_like_the_every_step_run_it_came_from(tmp_path):
    steps = WARM_AT + 3
    path, want = _every_step_checkpoint(tmp_path, 1, steps)
    config = dataclasses.replace(_every_step(1), sync=SyncConfig(
        mode="diloco", inner_steps=1, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)).validate()
    pods = Pods(config, 1)
    try:
        pods.pods[0].restore(path, None, f"warm-{next(_runs)}", _deadline(), warm_start=True)
        for step in range(WARM_AT, steps):
            assert pods.step(step)[0].outer is not None
        got = jax.tree.leaves(pods.pods[0].trainer.agreed_params)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    finally:
        pods.close()


def test_a_pod_that_syncs_every_step_refuses_a_warm_start(tmp_path):
    path, _ = _every_step_checkpoint(tmp_path, 1, WARM_AT + 1)
    pods = Pods(_every_step(1), 1)
    try:
        with pytest.raises(InvalidRequest, match="a warm start is for a pod in DiLoCo mode"):
            pods.pods[0].restore(path, None, f"warm-{next(_runs)}", _deadline(), warm_start=True)
    finally:
        pods.close()


def test_an_every_step_resume_refuses_to_go_back_past_a_newer_diloco_checkpoint(tmp_path):
    path, _ = _every_step_checkpoint(tmp_path, 1, WARM_AT + 1)
    directory = tmp_path / "every-step"
    diloco = (str(directory / "pod-0"), str(directory / "pod-1"))
    pods = Pods(_every_step(1), 1)
    try:
        pod = pods.pods[0]
        # A DiLoCo run warm-started there saved only its baseline, of the same step: nothing is lost.
        shutil.copytree(path, directory / "pod-0" / str(WARM_AT))
        assert pod.restore(None, str(directory), f"warm-{next(_runs)}", _deadline(),
                           diloco_directories=diloco).step == WARM_AT
        state = fingerprint(pod.trainer.params, pod.trainer.opt_state)
        # Once it has saved a later step, an every-step resume would go back past its work: refused.
        shutil.copytree(path, directory / "pod-1" / str(WARM_AT + 5))
        refused = (f"DiLoCo run saved a checkpoint of step {WARM_AT + 5} in .*pod-1, "
                   f"and its newest every-step checkpoint is of step {WARM_AT}")
        with pytest.raises(CheckpointError, match=refused):
            pod.restore(None, str(directory), f"warm-{next(_runs)}", _deadline(), diloco_directories=diloco)
        assert fingerprint(pod.trainer.params, pod.trainer.opt_state) == state and pod.trainer.step == WARM_AT
        # A directory that holds only a DiLoCo run's parts says so, not merely that it is empty.
        with pytest.raises(CheckpointError, match="holds no whole every-step checkpoint.*sync.mode = \"diloco\""):
            pod.restore(None, str(tmp_path / "none"), f"warm-{next(_runs)}", _deadline(), diloco_directories=diloco)
    finally:
        pods.close()
