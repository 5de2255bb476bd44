"""The step loop, driven with fake pods in-process: ordering, pipelining, and what stops it."""
from __future__ import annotations

import math
import time

import pytest

from multipod.controller.cluster.pods import Cluster
from multipod.controller.components.spike import Spike, SpikePolicy
from multipod.controller.core.errors import Divergence, PodFailure, RunError
from multipod.controller.observe.metrics import Accounting, Recorder
from multipod.controller.run.loop import StepLoop
from tests.unit.controller.fakes import (
    DEAD,
    HANG,
    HUNG,
    FakeBatches,
    FakePod,
    ListSink,
    NoProgress,
    make_config,
    step_reply,
    unavailable,
)


class BoundaryLog:
    """A checkpointer stand-in: logs every step boundary; drains the pipeline at `drain_at`."""

    def __init__(self, log: list, drain_at=()):
        self.log, self.drain_at = log, set(drain_at)

    def on_step(self, step: int, drain) -> bool:
        self.log.append(("boundary", step))
        if step in self.drain_at:
            drain()
            self.log.append(("saved", step))
        return step in self.drain_at


def _loop(pods, log=None, drain_at=(), health=None, spike=None, **run):
    """A StepLoop on `pods`; `run` sets [run] fields, `health` and `spike` those sections'."""
    log = log if log is not None else []
    config = make_config(run=run, health=health or {}, spike=spike or {})
    sink = ListSink(log)
    loop = StepLoop(Cluster(pods, config), FakeBatches(), BoundaryLog(log, drain_at), SpikePolicy(config.spike),
                    Recorder(sink, NoProgress()), Accounting(model_flops_per_token=1.0))
    return loop, sink


def test_happy_path_records_every_step_in_order_with_two_steps_in_flight():
    log: list = []
    pods = [FakePod(0, log=log), FakePod(1, log=[])]
    loop, sink = _loop(pods, log, steps=5, dispatch_depth=2)
    loop.run(0)
    assert [r.step for r in sink.records] == [0, 1, 2, 3, 4]
    assert all(r.loss == 2.0 and r.data_index == r.step for r in sink.records)
    # Depth 2: step s+1 is dispatched before step s is recorded; the last step is completed at
    # once; the final boundary (the end-of-run checkpoint) comes after every record.
    events = [(e[0], e[2]) if e[0] == "dispatch" else e for e in log]
    assert events == [("boundary", 0), ("dispatch", 0), ("boundary", 1), ("dispatch", 1), ("record", 0),
                      ("boundary", 2), ("dispatch", 2), ("record", 1), ("boundary", 3), ("dispatch", 3),
                      ("record", 2), ("boundary", 4), ("dispatch", 4), ("record", 3), ("record", 4),
                      ("boundary", 5)]


def test_depth_one_completes_each_step_before_the_next_and_data_offset_shifts_batches():
    log: list = []
    pods = [FakePod(0, log=log), FakePod(1)]
    loop, sink = _loop(pods, log, steps=3, dispatch_depth=1)
    loop.run(1, data_offset=5, restarts=2)
    events = [(e[0], e[2], e[3]) if e[0] == "dispatch" else e for e in log]
    assert events == [("boundary", 1), ("dispatch", 1, 6), ("record", 1), ("boundary", 2), ("dispatch", 2, 7),
                      ("record", 2), ("boundary", 3)]
    assert [(r.data_index, r.restarts) for r in sink.records] == [(6, 2), (7, 2)]


def test_a_checkpoint_boundary_drains_the_steps_in_flight_first():
    log: list = []
    loop, _ = _loop([FakePod(0, log=log), FakePod(1)], log, steps=5, dispatch_depth=2, drain_at=(3,))
    loop.run(0)
    saved = log.index(("saved", 3))
    assert ("record", 2) in log[:saved] and not any(e[0] == "dispatch" and e[2] == 3 for e in log[:saved])


def test_a_pod_that_fails_a_step_is_named_in_a_pod_failure():
    def step(pod, s, data):
        if pod == 1 and s == 2:
            raise unavailable(pods[1])
        return step_reply(pod, s)
    # The failed pod's health check is refused when the loop diagnoses the failure.
    pods = [FakePod(0, step), FakePod(1, step, probe_then=DEAD)]
    loop, sink = _loop(pods, steps=5)
    with pytest.raises(PodFailure) as info:
        loop.run(0)
    assert info.value.pods == (1,) and info.value.hung == ()
    assert "pod 1 (fake:1) is not responding" in str(info.value) and "step 2 failed" in str(info.value)
    assert [r.step for r in sink.records] == [0, 1]


def test_a_hung_pod_is_named_by_the_watchdog_within_seconds():
    def step(pod, s, data):
        return HANG if pod == 1 and s == 2 else step_reply(pod, s)
    hung = FakePod(1, step, probe_when_hung=HUNG)   # its health checks go silent with its step
    pods = [FakePod(0, step), hung]
    loop, sink = _loop(pods, steps=5, step_timeout_s=300.0)
    started = time.monotonic()
    with pytest.raises(PodFailure) as info:
        loop.run(0)
    assert time.monotonic() - started < 5      # far sooner than the 300 s step deadline
    assert info.value.pods == (1,) and info.value.hung == (1,)
    assert str(info.value).startswith("pod 1 (fake:1) is not responding: no answer")
    assert all(call.cancelled for call in hung.hanging)     # nothing is left in flight


def test_a_step_finished_by_the_survivors_when_a_pod_hung_before_its_reply_is_recorded_once():
    # Pod 1 sent its step-2 gradient (pod 0 finished step 2), then hung before its reply left;
    # pod 0's step 3 waits on it. The survivors carry on from step 3: step 2 comes from pod 0's reply.
    back = False

    def step(pod, s, data):
        if not back and ((pod == 1 and s >= 2) or (pod == 0 and s == 3)):
            return HANG
        return step_reply(pod, s)
    hung = FakePod(1, step, probe_when_hung=HUNG)
    loop, sink = _loop([FakePod(0, step), hung], steps=5, step_timeout_s=300.0, dispatch_depth=2)
    with pytest.raises(PodFailure) as info:
        loop.run(0)
    assert info.value.pods == (1,)
    back, hung.hanging = True, []      # what degraded mode does next, in short
    loop.run(3)
    assert [r.step for r in sink.records] == [0, 1, 2, 3, 4]
    partial = sink.records[2]
    assert partial.partial_loss and partial.tokens == 16     # pod 0's shard only
    assert not any(r.partial_loss for r in sink.records if r.step != 2)


@pytest.mark.parametrize("answer", ["finished", "aborted"])
def test_a_survivor_s_reply_that_comes_after_a_pod_went_silent_is_still_read(answer):
    # Pod 0's step-2 reply is not in yet when the watchdog names pod 1: its call is left running
    # (the membership change ends it), and read when the run goes on. A step it finished is
    # recorded once; a step the membership change aborted is run again.
    back = False

    def step(pod, s, data):
        if not back and ((pod == 1 and s >= 2) or (pod == 0 and s in (2, 3))):
            return HANG
        return step_reply(pod, s)
    survivor, hung = FakePod(0, step), FakePod(1, step, probe_when_hung=HUNG)
    loop, sink = _loop([survivor, hung], steps=5, step_timeout_s=300.0, dispatch_depth=2)
    with pytest.raises(PodFailure):
        loop.run(0)
    late, later = survivor.hanging     # steps 2 and 3
    assert not late.cancelled and later.cancelled
    back, hung.hanging = True, []
    if answer == "finished":
        late.finish(step_reply(0, 2))
        loop.run(3)
        assert [(r.step, r.partial_loss) for r in sink.records] == \
            [(0, False), (1, False), (2, True), (3, False), (4, False)]
    else:
        late.finish(error=unavailable(survivor))
        loop.run(2)
        assert [(r.step, r.partial_loss) for r in sink.records] == \
            [(0, False), (1, False), (2, False), (3, False), (4, False)]


def test_a_step_the_survivors_did_not_finish_when_a_pod_hung_is_run_again():
    # Both pods are stuck in step 2 (pod 1 hung before sending): nothing of step 2 is kept, and
    # the survivors run it again.
    back = False

    def step(pod, s, data):
        if not back and s >= 2:
            return HANG
        return step_reply(pod, s)
    hung = FakePod(1, step, probe_when_hung=HUNG)
    loop, sink = _loop([FakePod(0, step), hung], steps=4, step_timeout_s=300.0)
    with pytest.raises(PodFailure):
        loop.run(0)
    back, hung.hanging = True, []
    loop.run(2)
    assert [r.step for r in sink.records] == [0, 1, 2, 3]
    assert not any(r.partial_loss for r in sink.records)


def test_a_step_that_never_finishes_hits_the_progress_deadline():
    # The pods answer their health checks, yet no step finishes: the progress deadline fires.
    def step(pod, s, data):
        return HANG if s == 1 else step_reply(pod, s)
    loop, _ = _loop([FakePod(0, step), FakePod(1, step)], steps=4, step_timeout_s=300.0,
                    health={"progress_timeout_s": 0.5})
    started = time.monotonic()
    with pytest.raises(PodFailure, match=r"step 1: no step finished for 0.5s"):
        loop.run(0)
    assert time.monotonic() - started < 5


def test_two_diverged_pods_stop_the_loop_naming_the_step_and_the_pods_with_no_majority():
    def step(pod, s, data):
        return step_reply(pod, s, checksum="odd" if pod == 1 and s == 3 else None)
    loop, sink = _loop([FakePod(0, step), FakePod(1, step)], steps=5)
    with pytest.raises(Divergence, match=r"step 3: pods diverged") as info:
        loop.run(0)
    assert not isinstance(info.value, PodFailure)
    assert "pod 0: fp3, pod 1: odd" in str(info.value) and "no majority among 2 pods" in str(info.value)
    assert info.value.outvoted == () and info.value.majority is None
    assert [r.step for r in sink.records] == [0, 1, 2]     # the step no one can vouch for is not recorded


def test_a_pod_outvoted_by_the_majority_is_named_and_its_step_recorded():
    def step(pod, s, data):
        return step_reply(pod, s, checksum="odd" if pod == 1 and s == 3 else None)
    config = make_config(run={"steps": 5}, data={"global_batch": 6})
    sink = ListSink([])
    loop = StepLoop(Cluster([FakePod(p, step) for p in range(3)], config), FakeBatches(rows=6),
                    BoundaryLog([], ()), SpikePolicy(config.spike), Recorder(sink, NoProgress()),
                    Accounting(model_flops_per_token=1.0))
    with pytest.raises(Divergence, match=r"pod\(s\) \[1\] differ from the majority") as info:
        loop.run(0)
    assert info.value.outvoted == (1,) and info.value.majority == "fp3" and info.value.step == 3
    assert [r.step for r in sink.records] == [0, 1, 2, 3]  # the majority's state is the run's
    assert sink.records[-1].checksums == ("fp3", "odd", "fp3")


def test_a_nan_step_skipped_on_every_pod_is_recorded_and_the_run_goes_on():
    def step(pod, s, data):
        return step_reply(pod, s, skipped=s == 2, loss=math.nan if s == 2 else 2.0)
    loop, sink = _loop([FakePod(0, step), FakePod(1, step)], steps=5)
    loop.run(0)
    assert [r.skipped for r in sink.records] == [False, False, True, False, False]
    assert [r.skipped_steps for r in sink.records] == [0, 0, 1, 1, 1]


def test_pods_that_disagree_on_skipping_a_step_stop_the_run():
    def step(pod, s, data):
        return step_reply(pod, s, skipped=pod == 0 and s == 2)
    loop, _ = _loop([FakePod(0, step), FakePod(1, step)], steps=5)
    with pytest.raises(RunError, match=r"step 2: pods disagree on skipping the update") as info:
        loop.run(0)
    assert "pod 0 (fake:0): skipped" in str(info.value) and "pod 1 (fake:1): applied" in str(info.value)


def test_a_spike_is_raised_after_its_record_and_the_steps_in_flight_finish():
    def step(pod, s, data):
        return step_reply(pod, s, loss=50.0 if s == 4 else 2.0)
    log: list = []
    loop, sink = _loop([FakePod(0, step, log=log), FakePod(1, step)], log, steps=8,
                       spike={"policy": "rewind", "window": 3, "threshold": 3.0})
    with pytest.raises(Spike) as info:
        loop.run(0)
    assert info.value.step == 4 and info.value.loss == 50.0
    assert sink.records[-1].step == 4
    assert not any(e == ("boundary", 6) for e in log)


def test_the_fingerprint_is_asked_for_every_n_steps_and_compared_across_pods():
    def reply(pod, s, data):
        full = f"full{s}" if s in (2, 5) else ""
        if pod == 1 and s == 5:
            full = "other"
        return step_reply(pod, s, fingerprint=full)
    pods = [FakePod(0, step=reply), FakePod(1, step=reply)]
    loop, sink = _loop(pods, steps=8, fingerprint_every=3)
    with pytest.raises(RunError, match=r"step 5: .*state fingerprints differ.*pod 1 .*other"):
        loop.run(0)
    # Asked after 3 and 6 steps (steps 2 and 5), of every pod, and recorded where taken.
    for pod in pods:
        assert [r.step for r in pod.step_requests if r.take_fingerprint] == [2, 5]
    assert [r.fingerprints for r in sink.records[:3]] == [None, None, ("full2", "full2")]


def test_shards_travel_as_the_narrowest_dtype_of_the_vocabulary():
    pods = [FakePod(0), FakePod(1)]
    loop, _ = _loop(pods, steps=2, fingerprint_every=0)
    loop.run(0)
    from multipod.protos import codec
    assert {codec.decode(r.tokens).dtype.name for r in pods[0].step_requests} == {"uint8"}
    assert not any(r.take_fingerprint for r in pods[0].step_requests)
