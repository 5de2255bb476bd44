"""DiLoCo checkpoints taken while a pod is out (issue 22, items 4 and 5), in process: the survivor
holding a failed slot's state writes that slot's part (Pod.start_save with `slot`), so the
checkpoint is whole, and a pair resumed from it with both pods back continues bitwise as the run
that took it would have:

  - "replay": the part is the hosted replica's state, bitwise the failed pod's own part of the
    uninterrupted run at that step (a sync pending in both), and the resumed pair ends bitwise
    where the uninterrupted pair ends;
  - "drop": the part is a copy of the live pod's state, which is what the pod takes when it
    rejoins from a live peer, and a pair resumed from it trains bitwise as the rejoined pair;
  - a pod asked for a part it cannot write refuses, naming why, and writes nothing.
"""
from __future__ import annotations

import time

import pytest

from multipod.pod_worker import checkpoint
from multipod.pod_worker.errors import InvalidRequest
from tests.unit.pod_worker.test_diloco import DEADLINE_S, Pods, _config, _local, _runs, tokens
from tests.unit.pod_worker.test_rejoin import Call

STEPS = 14
SKIP = 3        # the batches a loss-spike rewind skips (spike.skip_batches)


def _deadline() -> float:
    return time.monotonic() + DEADLINE_S


def _save(pod, step: int, directory, slot: int | None = None) -> dict:
    """Pod `pod` writes a part of the checkpoint of `step` into `directory` (its own, or slot
    `slot`'s) and waits for it; the part's metadata."""
    pod.start_save(step, str(directory), {}, 0, _deadline(), slot=slot)
    return checkpoint.read_metadata(str(pod.wait_save(str(directory), step, DEADLINE_S)))


def _resume(config, parts: list, step: int) -> Pods:
    """A fresh pair, each pod restored to its own part of the checkpoint of `step`."""
    pods = Pods(config, 2)
    run_id = f"resumed-{next(_runs)}"
    calls = [Call(pod.restore, str(part / str(step)), None, run_id, _deadline()) for pod, part in zip(pods.pods, parts)]
    assert {call.result().step for call in calls} == {step}
    return pods


def test_a_replayed_slot_s_part_is_the_failed_pod_s_own_and_a_resume_from_it_is_bitwise(tmp_path):
    """Pod 1 dies after 7 steps (sync 4 pending on pod 0, its exchange broken), pod 0 replays its
    slot from its part of step 4 and saves both parts after 8 steps (the save exchanges sync 4 again
    on the new link, with the replica's pseudo-gradient), then trains the replica beside its own
    and saves again after 10 steps (sync 5 pending). Each part is bitwise the uninterrupted pair's
    part of that step (inner state, outer state, the pending sync's sum); the degraded run goes on
    bitwise; a fresh pair restored from the parts of step 8 ends bitwise where the uninterrupted
    pair ends (agreed state at every step, both inner states). Then a loss-spike rewind of the
    degraded run to step 10 (pod 0 restored, slot 1 adopted again from its part, SKIP batches
    skipped) trains bitwise as the uninterrupted pair with the same rewind."""
    config = _config(2, inner_steps=4, fragments=2, overlap_steps=1)
    reference = Pods(config, 2)
    parts = {}
    try:
        want = []
        for step in range(STEPS):
            if step in (8, 10):
                parts[step] = [_save(pod, step, tmp_path / "reference" / f"pod-{pod.pod_index}")
                               for pod in reference.pods]
            want.append(reference.step(step)[0].checksum)
        assert [parts[s][0]["outer"]["pending"]["sync"] for s in (8, 10)] == [4, 5], "each should hold a sync pending"
        want_local = [_local(pod) for pod in reference.pods]
    finally:
        reference.close()

    degraded = tmp_path / "degraded"
    pods = Pods(config, 2)
    first, second = pods.pods
    try:
        for step in range(4):
            pods.step(step)
        for pod in pods.pods:
            _save(pod, 4, degraded / f"pod-{pod.pod_index}")
        with pytest.raises(InvalidRequest, match="pod 1 is live"):
            first.start_save(4, str(degraded / "pod-1"), {}, 0, _deadline(), slot=1)
        for step in range(4, 7):
            pods.step(step)
        first.step(first.setup(), 7, tokens(7, 0), 0, _deadline(), lambda: True)   # sync 4 starts on pod 0 only
        second.close()      # pod 1 dies
        with pytest.raises(Exception, match="pod 1"):
            first.step(first.setup(), 8, tokens(8, 0), 0, _deadline(), lambda: True)
        first.set_membership(f"diloco-{next(_runs)}", [0, 0], _deadline())
        with pytest.raises(InvalidRequest, match="does not host slot 1's replica"):
            first.start_save(8, str(degraded / "pod-1"), {}, 0, _deadline(), slot=1)
        with pytest.raises(InvalidRequest, match="slot 2 is not a slot of this run of 2 pods"):
            first.start_save(8, str(degraded / "pod-2"), {}, 0, _deadline(), slot=2)
        assert checkpoint.steps(str(degraded / "pod-1")) == [4], "a refused part was written"
        first.adopt_slot(1, str(degraded / "pod-1" / "4"), [tokens(s, 1) for s in range(4, 8)], _deadline())

        for step in range(8, STEPS):
            if step in (8, 10):
                got = [_save(first, step, degraded / "pod-0"), _save(first, step, degraded / "pod-1", slot=1)]
                assert [meta["fingerprint"] for meta in got] == [meta["fingerprint"] for meta in parts[step]]
                assert [meta["outer"] for meta in got] == [parts[step][0]["outer"]] * 2
                assert got[1]["part"] == {"slot": 1, "written_by": 0, "source": "replica"} and "part" not in got[0]
            outcome, _ = first.step(first.setup(), step, tokens(step, 0), 0, _deadline(), lambda: True,
                                    extra={1: tokens(step, 1)})
            assert outcome.checksum == want[step], f"degraded step {step}"

        # A loss-spike rewind while pod 1 is out: pod 0 goes back to its part of step 10, which
        # clears the replica; slot 1 is adopted again from its own part of step 10 with nothing to
        # retake (Replayer.adopt_again), and the run goes on degraded on the batches after the skip.
        first.restore(str(degraded / "pod-0" / "10"), None, f"rewound-{next(_runs)}", _deadline())
        with pytest.raises(InvalidRequest, match="trains the replicas of slots"):
            first.step(first.setup(), 10, tokens(10 + SKIP, 0), 0, _deadline(), lambda: True,
                       extra={1: tokens(10 + SKIP, 1)})
        first.adopt_slot(1, str(degraded / "pod-1" / "10"), [], _deadline())
        rewound = [first.step(first.setup(), step, tokens(step + SKIP, 0), 0, _deadline(), lambda: True,
                              extra={1: tokens(step + SKIP, 1)})[0].checksum for step in range(10, STEPS)]
        rewound_local = _local(first)
        assert rewound[-1] != want[STEPS - 1], "the skipped batches should change the outer step of sync 6"
    finally:
        first.close()

    resumed = _resume(config, [degraded / "pod-0", degraded / "pod-1"], 8)
    try:
        for step in range(8, STEPS):
            assert [o.checksum for o in resumed.step(step)] == [want[step]] * 2, f"resumed step {step}"
        assert [_local(pod) for pod in resumed.pods] == want_local
        # The uninterrupted pair with the same rewind: back to its own parts of step 10, the same skip.
        run_id = f"rewound-{next(_runs)}"
        calls = [Call(pod.restore, str(tmp_path / "reference" / f"pod-{pod.pod_index}" / "10"), None, run_id,
                      _deadline()) for pod in resumed.pods]
        assert {call.result().step for call in calls} == {10}
        for step, checksum in zip(range(10, STEPS), rewound):
            got = [call.result()[0].checksum for call in
                   [Call(pod.step, pod.setup(), step, tokens(step + SKIP, pod.pod_index), 0, _deadline(), lambda: True)
                    for pod in resumed.pods]]
            assert got == [checksum] * 2, f"step {step} after the rewind"
        assert _local(resumed.pods[0]) == rewound_local
    finally:
        resumed.close()


def test_a_dropped_slot_s_part_is_what_a_rejoin_takes_and_a_resume_from_it_trains_as_the_rejoined_pair(tmp_path):
    """sync.on_pod_failure = "drop": pod 1 drops out after 5 steps, pod 0 trains alone (sync 3
    averages over pod 0 only) and after 7 steps writes its part and slot 1's: the same state, a
    copy of its own. Pod 1 then rejoins from pod 0's state, as the controller brings it back;
    a fresh pair restored from the two parts trains bitwise as the rejoined pair."""
    config = _config(2, inner_steps=4, fragments=2, overlap_steps=1, on_pod_failure="drop")
    saved = tmp_path / "drop"
    pods = Pods(config, 2)
    first, second = pods.pods
    try:
        for step in range(5):
            pods.step(step)
        first.set_membership(f"diloco-{next(_runs)}", [0, 0], _deadline())   # pod 1 is out
        outer = [first.step(first.setup(), step, tokens(step, 0), 0, _deadline(), lambda: True)[0].outer
                 for step in (5, 6)]
        assert outer[1] is not None and outer[1].pods == (0,), "sync 3 should average over pod 0 alone"
        parts = [_save(first, 7, saved / "pod-0"), _save(first, 7, saved / "pod-1", slot=1)]
        assert parts[0]["fingerprint"] == parts[1]["fingerprint"]
        assert parts[1]["part"]["source"].startswith("copy")
        # Pod 1 rejoins from pod 0 (no outer sync pending after 7 steps), as Failover.on_step does.
        transfer_id = f"rejoin-{next(_runs)}"
        receiving = Call(second.receive_state, transfer_id, 0, _deadline())
        first.send_state(transfer_id, 1, pods.listeners[1].address, _deadline())
        receiving.result()
        run_id = f"diloco-{next(_runs)}"
        for pod in pods.pods:
            pod.set_membership(run_id, None, _deadline())
        rejoined = [[o.checksum for o in pods.step(step)] for step in range(7, 11)]
        rejoined_local = [_local(pod) for pod in pods.pods]
    finally:
        pods.close()
    assert all(len(set(checksums)) == 1 for checksums in rejoined)

    resumed = _resume(config, [saved / "pod-0", saved / "pod-1"], 7)
    try:
        assert [[o.checksum for o in resumed.step(step)] for step in range(7, 11)] == rejoined
        assert [_local(pod) for pod in resumed.pods] == rejoined_local
    finally:
        resumed.close()
