"""Degraded mode in the step (issue 10): a survivor computes a failed pod's shard as an extra
microbatch, with the very program that pod would have run, and contributes it in that pod's slot.

  - PodTrainer.train_step(extra={slot: batch}) hands the exchange each extra shard's gradient
    bitwise equal to the one a trainer in the same state gets for that shard alone (fused step and
    dcn.overlap's per-layer programs), and reports every shard's loss, own first.
  - Three in-process Pods over loopback listeners: two steps with a pod gone and a survivor
    computing its slot (hosts [0, 0, 2], and others down to one pod computing every slot) leave
    the survivors bitwise where the healthy three-pod run leaves them (checksum and
    fingerprint), with the same per-shard losses; for the fused and the overlapped step.
  - Pod.step refuses extra shards that are not the ones the membership gives the pod.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time

import numpy as np
import pytest

from multipod.pod_worker.dcn import Listener
from multipod.pod_worker.errors import InvalidRequest
from multipod.pod_worker.pod import Pod
from multipod.pod_worker.schema import DcnConfig
from multipod.pod_worker.trainer import PodTrainer
from multipod.protos import multipod_pb2 as pb
from tests.helpers import tiny_worker_config

SECRET = "degraded-step-test-secret-0123456789"
NUM_PODS = 3
ROWS, COLS = 4, tiny_worker_config().train.seq_len + 1       # one pod's shard
GLOBAL_TOKENS = NUM_PODS * ROWS * (COLS - 1)
DEADLINE_S = 20.0
_runs = itertools.count()


# The Pods of this module run side by side in threads: on one device (conftest.py says why).
pytestmark = pytest.mark.usefixtures("pods_on_device_0")


def _config(overlap: bool = False):
    base = tiny_worker_config()
    # 12 sequences: 4 per pod for 3 pods.
    # A short exchange deadline: a step that cannot complete fails well before the test's timeouts.
    return dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=NUM_PODS * ROWS),
                               dcn=DcnConfig(overlap=overlap, timeout_s=20.0)).validate()


def tokens(step: int, slot: int) -> np.ndarray:
    """Slot `slot`'s shard of step `step`: the same whichever pod computes it."""
    return np.random.default_rng([step, slot]).integers(0, 256, (ROWS, COLS), dtype=np.int32)


def _run(prefix: str) -> str:
    return f"{prefix}-{next(_runs)}"


# -- PodTrainer.train_step with extra shards ---------------------------------------------------------
class Recorded(Exception):
    """Raised by a recording all_reduce to end the step after the exchange saw the gradients."""


class Recorder:
    """An all_reduce stand-in: keeps host copies of what it is given (own leaves, extra={slot:
    leaves}, order) and returns the own leaves as the "sum", or raises Recorded (the step fails
    before the update, so the trainer's state stays as it was)."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls: list[dict] = []

    def __call__(self, grads, extra=None, order=None):
        host = lambda leaves: [np.array(leaf) for leaf in leaves]
        self.calls.append({"own": host(grads), "extra": {slot: host(leaves) for slot, leaves in (extra or {}).items()},
                           "extra_order": list(extra or {}), "order": order})
        if self.fail:
            raise Recorded()
        return list(grads), None


def assert_leaves_bitwise(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert np.array_equal(a, b), f"leaf {i} differs"
        assert a.tobytes() == b.tobytes(), f"leaf {i} differs in its bits"


@pytest.fixture(scope="module", params=[False, True], ids=["fused", "overlap"])
def trainers(request):
    """Two trainers of the same config, in the same (initial) state."""
    config = _config(overlap=request.param)
    first, second = PodTrainer(config), PodTrainer(config)
    assert (first._overlapped is not None) == request.param
    return first, second


def test_extra_shards_get_the_gradient_their_own_pod_would_compute(trainers):
    survivor, reference = trainers
    assert survivor.fingerprint() == reference.fingerprint()      # the same state
    state = reference.fingerprint()
    # What a pod that owned each shard hands its exchange: slots 0 and 2 from steps that then
    # fail (the state stays as it was, so every shard is taken from the same state) ...
    alone = {}
    for slot in (0, 2):
        recorder = Recorder(fail=True)
        with pytest.raises(Recorded):
            reference.train_step(reference.put_batch(tokens(0, slot)), GLOBAL_TOKENS, recorder)
        assert reference.fingerprint() == state and reference.step == 0
        alone[slot] = recorder.calls[0]
    # ... and slot 1 from a step that completes (its losses are the outcome's).
    recorder = Recorder()
    owned = reference.train_step(reference.put_batch(tokens(0, 1)), GLOBAL_TOKENS, recorder)
    alone[1] = recorder.calls[0]
    assert all(not call["extra"] for call in alone.values())

    # The survivor computes its own shard (slot 0) and those of slots 2 and 1 (given unsorted).
    recorder = Recorder()
    extra = {2: survivor.put_batch(tokens(0, 2)), 1: survivor.put_batch(tokens(0, 1))}
    outcome = survivor.train_step(survivor.put_batch(tokens(0, 0)), GLOBAL_TOKENS, recorder, extra=extra)
    assert len(recorder.calls) == 1
    call = recorder.calls[0]
    assert call["extra_order"] == [1, 2]                # kept apart, by slot
    assert_leaves_bitwise(call["own"], alone[0]["own"])
    for slot in (1, 2):
        assert_leaves_bitwise(call["extra"][slot], alone[slot]["own"])
    assert any(np.abs(leaf).max() > 0 for leaf in call["extra"][2])
    assert not all(np.array_equal(a, b) for a, b in zip(call["extra"][1], call["extra"][2]))
    if survivor._overlapped is not None:     # the per-layer programs: leaves taken in readiness order
        assert call["order"] == alone[0]["order"] == survivor._overlapped.order
    else:
        assert call["order"] is None

    # Every shard's losses, own first; the step's loss is their sum.
    assert [s[0] for s in outcome.shards] == [None, 1, 2]
    assert outcome.shards[1] == (1, owned.loss_sum, owned.z_loss_sum, owned.tokens)
    assert outcome.shards[0][3] == outcome.shards[2][3] == ROWS * (COLS - 1)
    assert outcome.loss_sum == sum(s[1] for s in outcome.shards)
    assert outcome.z_loss_sum == sum(s[2] for s in outcome.shards)
    assert outcome.tokens == NUM_PODS * ROWS * (COLS - 1)
    assert owned.shards == [(None, owned.loss_sum, owned.z_loss_sum, owned.tokens)]
    assert survivor.step == 1


def test_extra_shards_without_an_exchange_are_refused(trainers):
    trainer = trainers[0]
    step, state = trainer.step, trainer.fingerprint()
    with pytest.raises(ValueError, match="extra shards need an exchange"):
        trainer.train_step(trainer.put_batch(tokens(5, 0)), GLOBAL_TOKENS, None,
                           extra={1: trainer.put_batch(tokens(5, 1))})
    assert trainer.step == step and trainer.fingerprint() == state


# -- three Pods over the data plane ------------------------------------------------------------------
class Cluster:
    """Three configured Pods on loopback listeners, and a checkpoint to put them back in one state."""

    def __init__(self, config):
        self.listeners = [Listener(i, "127.0.0.1:0", SECRET) for i in range(NUM_PODS)]
        self.addresses = [lst.address for lst in self.listeners]
        self.pods = [Pod(i, lst) for i, lst in enumerate(self.listeners)]
        for pod in self.pods:
            pod.configure(config, NUM_PODS, self.addresses, _run("configure"))
            trainer = pod.trainer
            if trainer._overlapped is not None:
                # Configure compiles the fused programs only; compile the per-layer ones now (a
                # launch changes no state), so that no pod's first exchange waits on a peer's compile.
                norm = trainer._normalizer(GLOBAL_TOKENS)
                launched = trainer._overlapped.launch(trainer.params, trainer.put_batch(tokens(0, 0)), norm)
                launched.backward_end(timeout=300)

    def reset(self, path: str, pods: list[Pod], run_id: str, hosts) -> None:
        """Restore `pods` to the checkpoint at `path` and have them exchange under run_id among hosts."""
        for pod in pods:
            pod.restore(path, None, "", time.monotonic() + DEADLINE_S)
            pod.set_membership(run_id, hosts, time.monotonic() + DEADLINE_S)

    def step(self, step: int, pods: list[Pod], extra: dict[int, list[int]] | None = None) -> dict:
        """Step `step` on `pods` at once (pod p computes its own shard and those of extra[p]);
        {pod index: outcome}."""
        extra = extra or {}
        with concurrent.futures.ThreadPoolExecutor(len(pods)) as pool:
            futures = {pod.pod_index: pool.submit(
                pod.step, pod.setup(), step, tokens(step, pod.pod_index), GLOBAL_TOKENS,
                time.monotonic() + DEADLINE_S, lambda: True, take_fingerprint=True,
                extra={slot: tokens(step, slot) for slot in extra.get(pod.pod_index, [])})
                for pod in pods}
            return {index: future.result(timeout=60)[0] for index, future in futures.items()}

    def close(self) -> None:
        for pod in self.pods:
            pod.close()


@pytest.fixture(scope="module")
def cluster():
    made = Cluster(_config())
    yield made
    made.close()


@pytest.fixture(scope="module")
def overlap_cluster():
    made = Cluster(_config(overlap=True))
    yield made
    made.close()


def save(cluster: Cluster, directory) -> str:
    """A checkpoint of pod 0's current state (the start of the runs to compare)."""
    pod = cluster.pods[0]
    step = pod.trainer.step
    pod.start_save(step, str(directory), {}, 0, time.monotonic() + DEADLINE_S)
    return str(pod.wait_save(str(directory), step, DEADLINE_S))


# hosts[slot]: the pod computing slot's shard. A survivor may take a slot below or above its own,
# several slots, or all of them.
ASSIGNMENTS = [(0, 0, 2), (1, 1, 2), (0, 2, 2), (0, 0, 0)]


@pytest.mark.parametrize("mode", ["fused", "overlap"])
def test_a_degraded_step_is_bitwise_the_healthy_step(request, tmp_path, mode):
    cluster = request.getfixturevalue("cluster" if mode == "fused" else "overlap_cluster")
    checkpoint = save(cluster, tmp_path)
    cluster.reset(checkpoint, cluster.pods, _run("healthy"), None)
    start = cluster.pods[0].trainer.step
    healthy = [cluster.step(start + k, cluster.pods) for k in range(2)]
    for want in healthy:
        assert len({(o.checksum, o.fingerprint) for o in want.values()}) == 1
    # The run did change the state (the comparison means something).
    assert healthy[0][0].fingerprint != healthy[1][0].fingerprint

    for hosts in ASSIGNMENTS:
        live = [cluster.pods[p] for p in sorted(set(hosts))]
        extra = {p.pod_index: [s for s, h in enumerate(hosts) if h == p.pod_index and s != p.pod_index]
                 for p in live}
        cluster.reset(checkpoint, live, _run("degraded"), list(hosts))      # the other pods are gone
        assert {p.pod_index: p.setup().extra_slots(p.pod_index) for p in live} == extra
        degraded = [cluster.step(start + k, live, extra=extra) for k in range(2)]
        for k, want in enumerate(healthy):
            for pod, got in degraded[k].items():
                assert (got.checksum, got.fingerprint) == (want[0].checksum, want[0].fingerprint), \
                    f"hosts {hosts}, step {start + k}: pod {pod}'s state differs from the healthy run's"
                assert got.grad_norm == want[0].grad_norm and got.skipped == want[0].skipped
                # Each shard's losses are bitwise those of the pod that owned it in the healthy run.
                assert got.shards == [(None if slot == pod else slot, want[slot].loss_sum, want[slot].z_loss_sum,
                                       want[slot].tokens) for slot in [pod, *extra[pod]]]
                assert got.loss_sum == sum(want[slot].loss_sum for slot in [pod, *extra[pod]])
        for pod in live:
            assert pod.trainer.fingerprint() == healthy[1][0].fingerprint
            assert pod.trainer.step == start + 2


def test_a_step_refuses_extra_shards_that_do_not_match_the_hosts(cluster, tmp_path):
    p0, p1, p2 = cluster.pods
    checkpoint = save(cluster, tmp_path)
    cluster.reset(checkpoint, cluster.pods, _run("healthy"), None)
    step = p0.trainer.step
    shard = lambda slot: tokens(step, slot)

    def refused(pod: Pod, extra, match: str) -> None:
        before = (pod.status(), pod.seq.next_step, pod.seq.epoch)
        with pytest.raises(InvalidRequest, match=match):
            pod.step(pod.setup(), step, shard(pod.pod_index), GLOBAL_TOKENS, time.monotonic() + DEADLINE_S,
                     lambda: True, extra=extra)
        assert (pod.status(), pod.seq.next_step, pod.seq.epoch) == before    # nothing ran, nothing changed
        assert pod.status().state == pb.WORKER_STATE_READY

    # Healthy: nobody computes another pod's shard.
    refused(p0, {1: shard(1)}, r"computes the extra shards of slots \[\], the request carries \[1\]")
    # Pod 1 gone, pod 0 computes its slot: exactly slot 1, on pod 0 only.
    run_id = _run("degraded")
    for pod in (p0, p2):
        pod.set_membership(run_id, [0, 0, 2], time.monotonic() + DEADLINE_S)
    for extra, carries in ((None, r"\[\]"), ({}, r"\[\]"), ({2: shard(2)}, r"\[2\]"),
                           ({1: shard(1), 2: shard(2)}, r"\[1, 2\]")):
        refused(p0, extra, rf"slots \[1\], the request carries {carries}")
    refused(p2, {1: shard(1)}, r"slots \[\], the request carries \[1\]")
    # The refusals consumed nothing: the right step still runs on both.
    outcomes = cluster.step(step, [p0, p2], extra={0: [1]})
    assert outcomes[0].checksum == outcomes[2].checksum
    assert p0.trainer.step == p2.trainer.step == step + 1
