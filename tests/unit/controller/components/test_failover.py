"""Degraded mode on the controller's side, with fake pods: who computes a failed pod's shard, what
the live pods are sent, and that a degraded step reports the loss a healthy one would."""
from __future__ import annotations

import pytest

from multipod.controller.cluster.pods import Cluster
from multipod.controller.components.failover import Failover, reassign
from multipod.controller.components.spike import SpikePolicy
from multipod.controller.core.errors import PodFailure, RunError
from multipod.controller.observe.metrics import Accounting, Recorder, step_record
from multipod.controller.run.loop import StepLoop
from multipod.protos import codec, multipod_pb2 as pb
from tests.unit.controller.fakes import FakeBatches, FakePod, ListSink, NoProgress, make_config, step_reply


class NoCheckpoints:
    def on_step(self, step: int, drain) -> bool:
        return False


def test_a_failed_pod_s_slot_goes_to_the_live_pod_with_the_fewest_shards():
    assert reassign([0, 1, 2], {1}) == [0, 0, 2]
    assert reassign([0, 0, 2], {2}) == [0, 0, 0]
    assert reassign([0, 1, 2, 3], {1, 2}) == [0, 0, 3, 3]
    assert reassign([0, 0, 2, 3], {3}) == [0, 0, 2, 2]      # pod 2 had one shard, pod 0 two
    with pytest.raises(RunError, match="every pod has failed"):
        reassign([0, 1], {0, 1})


def test_live_pods_get_the_failed_pods_shards_as_extra_shards_in_their_slots():
    pods = [FakePod(i) for i in range(3)]
    config = make_config(run={"steps": 2})
    cluster = Cluster(pods, config)
    cluster.hosts = [0, 0, 2]
    sink = ListSink()
    loop = StepLoop(cluster, FakeBatches(rows=6), NoCheckpoints(), SpikePolicy(config.spike),
                    Recorder(sink, NoProgress()), Accounting(model_flops_per_token=1.0))
    loop.run(0)
    assert pods[1].step_requests == []                       # the failed pod gets nothing
    request = pods[0].step_requests[0]
    assert [s.slot for s in request.extra_shards] == [1]
    own, extra = codec.decode(request.tokens), codec.decode(request.extra_shards[0].tokens)
    assert own.shape == extra.shape == (2, 9)       # slot 1's rows of the batch, as pod 1 would get them
    assert pods[2].step_requests[0].extra_shards == []
    assert [r.hosts for r in sink.records] == [(0, 0, 2)] * 2
    assert [r.live_pods for r in sink.records] == [2, 2]


def test_a_degraded_step_reports_the_loss_of_the_healthy_step_bit_for_bit():
    # Three shards with losses that do not sum associatively in floating point.
    losses = {0: 0.1, 1: 0.2, 2: 0.3}
    healthy = [step_reply(p, 0, loss=losses[p], tokens=10) for p in range(3)]
    for reply in healthy:
        reply.shards.add(slot=reply.pod_index, loss_sum=reply.loss_sum, tokens=reply.tokens)
    degraded_0 = step_reply(0, 0, loss=0.0, tokens=20)
    degraded_0.shards.add(slot=0, loss_sum=healthy[0].loss_sum, tokens=10)
    degraded_0.shards.add(slot=1, loss_sum=healthy[1].loss_sum, tokens=10)
    degraded_0.loss_sum = healthy[0].loss_sum + healthy[1].loss_sum
    accounting = Accounting(model_flops_per_token=1.0)
    position = dict(data_index=0, epoch=0.1, skipped_steps=0, restarts=0)
    a = step_record(0, healthy, 1.0, accounting, **position)
    b = step_record(0, [degraded_0, healthy[2]], 1.0, accounting, hosts=[0, 0, 2], **position)
    assert a.loss == b.loss and a.tokens == b.tokens == 30
    assert b.hosts == (0, 0, 2) and b.live_pods == 2


class MemberPod(FakePod):
    """A fake pod that answers SetMembership with its step and state hash."""

    def __init__(self, pod_index: int, step: int = 3, state: str = "s3", fails: bool = False):
        super().__init__(pod_index)
        self.at, self.state, self.fails = step, state, fails
        self.memberships: list[pb.MembershipRequest] = []

    def set_membership(self, request, timeout_s):
        from tests.unit.controller.fakes import unavailable
        if self.fails:
            raise unavailable(self, "SetMembership")
        self.memberships.append(request)
        return pb.MembershipReply(step=self.at, checksum="c", fingerprint=self.state)


class Events:
    def __init__(self):
        self.events = []

    def write(self, event, **fields):
        self.events.append((event, fields))


def test_degrade_gives_the_survivors_the_new_hosts_and_continues_where_they_are():
    pods = [MemberPod(0), MemberPod(1), MemberPod(2)]
    cluster = Cluster(pods, make_config(recovery={"max_restarts": 3, "restart_timeout_s": 0.1}))
    events = Events()
    failover = Failover(cluster.config.recovery, cluster, events)
    try:
        step = failover.degrade(PodFailure("pod 1 died", [1]))
    finally:
        failover.close()
    assert step == 3 and cluster.hosts == [0, 0, 2] and cluster.live == [0, 2]
    assert pods[1].memberships == []
    for pod in (pods[0], pods[2]):
        (request,) = pod.memberships
        assert list(request.hosts) == [0, 0, 2] and request.num_pods == 3 and request.run_id == cluster.run_id
    assert [e for e, _ in events.events] == ["pod_failure", "degraded"]


def test_degrade_refuses_survivors_that_diverged_and_counts_failures():
    pods = [MemberPod(0, state="a"), MemberPod(1), MemberPod(2, state="b")]
    config = make_config(recovery={"max_restarts": 1, "restart_timeout_s": 0.1})
    failover = Failover(config.recovery, Cluster(pods, config), Events())
    try:
        with pytest.raises(RunError, match="diverged"):
            failover.degrade(PodFailure("pod 1 died", [1]))
        with pytest.raises(RunError, match="Giving up after 1 pod failure"):
            failover.degrade(PodFailure("pod 2 died", [2]))
    finally:
        failover.close()


def test_diloco_survivors_at_different_steps_go_back_to_the_last_checkpoint_together():
    """An outer exchange that reached one survivor and not another leaves DiLoCo pods at different
    steps, whose states no peer can stand in for: every live pod goes back to the last checkpoint
    (restore_checkpoint) and the run goes on degraded from there; without it, the run stops."""
    config = make_config(recovery={"max_restarts": 3, "restart_timeout_s": 0.1},
                         sync={"mode": "diloco", "inner_steps": 4, "on_pod_failure": "replay"})

    def survivors():
        return [MemberPod(0, step=14), MemberPod(1), MemberPod(2, step=12)]

    failover = Failover(config.recovery, Cluster(survivors(), config), Events())
    try:
        with pytest.raises(RunError, match=r"stopped at different steps \(\{0: 14, 2: 12\}\).*--resume"):
            failover.degrade(PodFailure("pod 1 died", [1]))
    finally:
        failover.close()
    events, restores, replays = Events(), [], []
    cluster = Cluster(survivors(), config)
    failover = Failover(config.recovery, cluster, events)
    failover.restore_checkpoint = lambda: restores.append(cluster.live) or 8
    failover.replayer = type("Replays", (), {"replay": lambda self, *args: replays.append(args)})()
    try:
        assert failover.degrade(PodFailure("pod 1 died", [1])) == 8
    finally:
        failover.close()
    # Restored once, on the new membership (slot 1 on pod 0); the restore adopted the slot again,
    # so no replay up to a survivor's step follows.
    assert restores == [[0, 2]] and replays == [] and failover.realigned == 1
    assert cluster.hosts == [0, 0, 2]
    realigned = [f for e, f in events.events if e == "realigned"]
    assert realigned == [{"step": 8, "steps": {"0": 14, "2": 12}}]
    assert [e for e, _ in events.events][-1] == "degraded"


def test_a_pod_restarted_between_two_health_checks_is_still_named():
    """A supervisor can bring a worker back before the watchdog misses two checks: the pod serves,
    but it is a new process that is not configured. The diagnosis names it all the same."""
    pods = [FakePod(0), FakePod(1), FakePod(2)]
    cluster = Cluster(pods, make_config())
    cluster.collect_dcn_addresses()          # as at configure: every pod's process is noted
    pods[1].configured = False               # pod 1 came back as a fresh process
    failure = cluster.diagnose("step 7 failed: every error was UNAVAILABLE")
    assert failure.pods == (1,) and "restarted: it is not configured" in str(failure)
    pods[1].configured = True
    assert cluster.diagnose("nothing wrong").pods == ()
