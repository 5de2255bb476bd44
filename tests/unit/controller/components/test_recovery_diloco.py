"""A restore in a degraded DiLoCo run (a loss-spike rewind, or a recovery): the restore clears the
replicas the survivors host, so with sync.on_pod_failure = "replay" each failed slot is adopted
again from its own part of the checkpoint restored, with nothing to retake (Replayer.adopt_again);
with "drop", or no pod out, nothing is adopted."""
from __future__ import annotations

import pytest

from multipod.controller.components.checkpointer import Saved
from multipod.controller.components.recovery import Recovery
from multipod.controller.components.replay import Replayer
from multipod.controller.components.spike import Spike, SpikePolicy
from multipod.controller.core.errors import RunError
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.components.test_checkpointer import _diloco_checkpointer


def _rewind(tmp_path, hosts: list[int], on_pod_failure: str = "replay"):
    """Rewind a loss spike at step 11 to the checkpoint of step 8; the pods' calls."""
    checkpointer, pods = _diloco_checkpointer(tmp_path, hosts, on_pod_failure)
    for pod in pods:
        pod.adopt_slot = lambda request, timeout_s, pod=pod: (
            pod.calls.append(("AdoptSlot", request)) or pb.AdoptSlotReply(step=8, fingerprint="replica"))
    cluster = checkpointer.cluster
    checkpointer.last_good = Saved(8, "ckpt/pod-0/8")
    recovery = Recovery(cluster.config.recovery, cluster, checkpointer, SpikePolicy(cluster.config.spike),
                        checkpointer.events)
    recovery.replayer = Replayer(cluster, checkpointer, None, checkpointer.events)
    assert recovery.rewind(Spike(11, 9.0, 3.0)) == 8
    return pods


@pytest.mark.parametrize("on_pod_failure", ["replay", "drop"])
def test_a_rewind_while_a_pod_is_out_adopts_its_slot_again_from_its_restored_part(tmp_path, on_pod_failure):
    pods = _rewind(tmp_path, [0, 1, 1], on_pod_failure)      # pod 2 out, its slot on pod 1
    assert [[m for m, _ in pod.calls] for pod in pods] == [
        ["Restore"], ["Restore"] + (["AdoptSlot"] if on_pod_failure == "replay" else []), []]
    assert [pod.calls[0][1].path for pod in pods[:2]] == ["ckpt/pod-0/8", "ckpt/pod-1/8"]
    if on_pod_failure == "replay":
        adopt = pods[1].calls[1][1]
        assert (adopt.slot, adopt.checkpoint_path, list(adopt.tokens)) == (2, "ckpt/pod-2/8", [])


def test_a_rewind_with_every_pod_live_adopts_nothing(tmp_path):
    pods = _rewind(tmp_path, [0, 1])
    assert [[m for m, _ in pod.calls] for pod in pods] == [["Restore"], ["Restore"]]


def test_going_back_to_the_last_checkpoint_while_a_pod_is_out_restores_the_live_pods_and_adopts_its_slot(tmp_path):
    """Recovery.restore_last_good, the failover's realignment of DiLoCo survivors that stopped at
    different steps: the live pods restore the last good checkpoint, the failed slot is adopted
    again from its part, and the spike policy's history starts there."""
    checkpointer, pods = _diloco_checkpointer(tmp_path, [0, 1, 1], "replay")      # pod 2 out
    for pod in pods:
        pod.adopt_slot = lambda request, timeout_s, pod=pod: (
            pod.calls.append(("AdoptSlot", request)) or pb.AdoptSlotReply(step=8, fingerprint="replica"))
    cluster = checkpointer.cluster
    checkpointer.last_good = Saved(8, "ckpt/pod-0/8")
    spike = SpikePolicy(cluster.config.spike)
    recovery = Recovery(cluster.config.recovery, cluster, checkpointer, spike, checkpointer.events)
    recovery.replayer = Replayer(cluster, checkpointer, None, checkpointer.events)
    assert recovery.restore_last_good() == 8
    assert [[m for m, _ in pod.calls] for pod in pods] == [["Restore"], ["Restore", "AdoptSlot"], []]
    assert recovery.restarts == 0 and recovery.rewinds == 0     # neither a restart nor a spike's rewind
    checkpointer.last_good = None
    with pytest.raises(RunError, match="no checkpoint to go back to"):
        recovery.restore_last_good()
