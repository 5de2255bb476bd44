"""A failed pod's shard split by microbatch over every survivor (issue 21, item 2), in process:
N pods (PodTrainers of one device each, real Exchanges over loopback listeners) run
two healthy steps; then, from the same start, pod 1 is gone and the survivors run the same two
steps with slot 1's microbatches spread over all of them (controller/components/failover.py
`split_microbatches`, pod_worker/split.py), the partial sums passed along over the data plane.
Every survivor ends each step bitwise where the healthy pods are (checksum and fingerprint), every
survivor computed part of slot 1 (all but slot 1's host passed a partial sum on), and slot 1's
host reports its loss bitwise as pod 1 did.

For N = 3 and 4 with model.microbatches >= N - 1, the fused step and dcn.overlap's."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools

import jax
import numpy as np
import pytest

from multipod.controller.components.failover import split_microbatches
from multipod.pod_worker.dcn import Exchange, Listener
from multipod.pod_worker.schema import DcnConfig, MeshConfig
from multipod.pod_worker.split import Piece, Relay, my_run
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config

SECRET = "split-step-test-secret-0123456789"
ROWS, COLS = 12, tiny_worker_config().train.seq_len + 1    # one pod's shard: 2, 3 or 4 microbatches
STEPS = 2
DEADLINE_S = 120.0
FAILED = 1
_runs = itertools.count()


def _config(pods: int, microbatches: int, overlap: bool):
    base = tiny_worker_config()
    return dataclasses.replace(
        base, mesh=MeshConfig(data=1, model=1), model=dataclasses.replace(base.model, microbatches=microbatches),
        train=dataclasses.replace(base.train, global_batch=pods * ROWS),
        dcn=DcnConfig(overlap=overlap, timeout_s=DEADLINE_S)).validate()


def _tokens(step: int, slot: int) -> np.ndarray:
    return np.random.default_rng([step, slot]).integers(0, 256, (ROWS, COLS), dtype=np.int32)


class Pods:
    """`pods` trainers, one device each, all in the same initial state."""

    def __init__(self, config, pods: int):
        self.config, self.count = config, pods
        # One device for every pod: 1-device programs have no collectives, so threads may share
        # it, and every pod's programs have one cache key. Compiled here, one pod after another:
        # the first compiles, the others load it (threads compiling at once would each compile).
        self.trainers = [PodTrainer(config, [jax.devices()[0]]) for p in range(pods)]
        for t in self.trainers:
            t.compile_for((ROWS, COLS))
            t.warm_up((ROWS, COLS), evaluate=False)
        self.start = self.trainers[0].host_state()
        self.listeners = [Listener(p, "127.0.0.1:0", SECRET) for p in range(pods)]

    def run(self, hosts: list[int]) -> list[dict]:
        """STEPS steps from the initial state on the pods in `hosts` ({pod: outcome} by step), a
        failed slot split as the controller splits it."""
        live = sorted(set(hosts))
        for p in live:
            t = self.trainers[p]
            t.load_state(self.start["params"], self.start["opt_state"], self.start["step"])
        run_id = f"split-{next(_runs)}"
        degraded = hosts != list(range(self.count))
        exchanges = {p: Exchange(run_id, p, [lst.address for lst in self.listeners], self.trainers[p].exchange_specs,
                                 self.listeners[p], dcn=self.config.dcn, hosts=hosts if degraded else None)
                     for p in live}
        splits = split_microbatches(hosts, self.config.model.microbatches)
        self.sent: list[tuple[int, int, int, int]] = []     # (step, slot, from pod, to pod) of partial sums

        def step(p: int, s: int):
            trainer, exchange = self.trainers[p], exchanges[p]
            exchange.inbox.set_next_step(s)
            pieces = [Piece(slot, trainer.put_batch(_tokens(s, slot)), *my_run(run, p, slot, hosts))
                      for slot, run in splits.items() if p in run]
            def send(slot, pod, leaves, losses):
                self.sent.append((s, slot, p, pod))
                return exchange.send_partial(s, slot, pod, leaves, losses)
            relay = Relay(send=send, receive=lambda slot, pod: exchange.receive_partial(s, slot, pod))
            all_reduce = lambda grads, **kw: exchange.all_reduce(s, grads, on_leaf=trainer.summed_leaf_hook(), **kw)
            return trainer.train_step(trainer.put_batch(_tokens(s, p)), self.count * ROWS * (COLS - 1), all_reduce,
                                      take_fingerprint=True, pieces=pieces, relay=relay)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(live)) as pool:
                return [{p: f.result(timeout=5 * DEADLINE_S) for p, f in
                         [(p, pool.submit(step, p, s)) for p in live]} for s in range(STEPS)]
        finally:
            for exchange in exchanges.values():
                exchange.close()

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()


@pytest.mark.parametrize("pods,microbatches,overlap", [(3, 2, False), (4, 3, False), (4, 4, True)],
                         ids=["3-pods-2-microbatches", "4-pods-3-microbatches", "4-pods-4-microbatches-overlap"])
def test_a_split_degraded_step_is_bitwise_the_healthy_step(pods, microbatches, overlap):
    cluster = Pods(_config(pods, microbatches, overlap), pods)
    try:
        assert all((t._overlapped is not None) == overlap for t in cluster.trainers)
        healthy = cluster.run(list(range(pods)))
        hosts = list(range(pods))
        hosts[FAILED] = 0
        degraded = cluster.run(hosts)
    finally:
        cluster.close()
    live = [p for p in range(pods) if p != FAILED]
    # The chain: every survivor but slot 1's host (pod 0, last) passed its partial sum on, once a step.
    chain = [q for q in live if q != 0] + [0]
    assert sorted(cluster.sent) == sorted((s, FAILED, p, to) for s in range(STEPS) for p, to in zip(chain, chain[1:]))
    for s in range(STEPS):
        want = healthy[s][0]
        assert len({(o.checksum, o.fingerprint) for o in healthy[s].values()}) == 1
        for p in live:
            got = degraded[s][p]
            assert (got.checksum, got.fingerprint) == (want.checksum, want.fingerprint), f"step {s}, pod {p}"
            assert got.grad_norm == want.grad_norm and not got.skipped
            # Slot 1's host reports its loss, bitwise pod 1's; the others report their own shard only.
            lost = healthy[s][FAILED]
            assert got.shards == [(None, healthy[s][p].loss_sum, healthy[s][p].z_loss_sum, healthy[s][p].tokens)] + \
                ([(FAILED, lost.loss_sum, lost.z_loss_sum, lost.tokens)] if p == 0 else [])
    assert healthy[0][0].fingerprint != healthy[1][0].fingerprint     # the state did change


def test_the_chain_is_checked():
    hosts = (0, 0, 2)
    assert my_run([2, 0], 2, 1, hosts) == (0, 1, None, 0)
    assert my_run([2, 0], 0, 1, hosts) == (1, 2, 2, None)
    assert my_run([2, 2, 0], 2, 1, hosts) == (0, 2, None, 0)
    with pytest.raises(ValueError, match="last microbatch must be on its host, pod 0"):
        my_run([0, 2], 2, 1, hosts)
    with pytest.raises(ValueError, match="two runs"):
        my_run([2, 0, 2, 0], 2, 1, hosts)
    with pytest.raises(ValueError, match="not live"):
        my_run([1, 0], 0, 1, hosts)
    with pytest.raises(ValueError, match="computes none"):
        my_run([0, 0], 2, 1, hosts)


# -- Pod.step: the split comes in the request ----------------------------------------------------
def test_pods_run_a_split_step_and_refuse_splits_that_do_not_fit(request):
    """Pods (pod_worker/pod.py) over loopback, pod 1 gone: a step whose extra shard carries
    microbatch_hosts runs split and ends bitwise where the healthy step does; a split that does
    not fit the membership is refused (InvalidRequest) before anything runs."""
    import time

    from multipod.pod_worker import pod as pod_module
    from multipod.pod_worker.errors import InvalidRequest

    config = _config(3, 2, False)
    reference = Pods(config, 3)
    try:
        healthy = reference.run([0, 1, 2])[0]
    finally:
        reference.close()
    # Both Pods' trainers on device 0, as in Pods above (one-device programs: no collectives).
    request.getfixturevalue("pods_on_device_0")
    listeners = [Listener(p, "127.0.0.1:0", SECRET) for p in (0, 1, 2)]
    addresses = [lst.address for lst in listeners]
    p0, p2 = pods = [pod_module.Pod(p, listeners[p]) for p in (0, 2)]
    try:
        for pod in pods:
            pod.configure(config, 3, addresses, "configure")
            pod.set_membership("split", [0, 0, 2], time.monotonic() + DEADLINE_S)
        shard = lambda slot: _tokens(0, slot)
        global_tokens = 3 * ROWS * (COLS - 1)
        deadline = lambda: time.monotonic() + DEADLINE_S
        for pod, extra, splits, match in [
                (p0, {1: shard(1)}, {1: [0, 2]}, "last microbatch must be on its host, pod 0"),
                (p0, {1: shard(1)}, {1: [2, 0, 0]}, "3 microbatch hosts, the model has 2"),
                (p2, {1: shard(1)}, {1: [0, 0]}, "pod 2 computes none"),
                (p2, {1: shard(1)}, {1: [1, 0]}, "not live"),
                (p2, {}, {1: [2, 0]}, r"the request carries \[\]")]:
            with pytest.raises(InvalidRequest, match=match):
                pod.step(pod.setup(), 0, shard(pod.pod_index), global_tokens, deadline(), lambda: True,
                         extra=extra, splits=splits)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {pod.pod_index: pool.submit(pod.step, pod.setup(), 0, shard(pod.pod_index), global_tokens,
                                                  deadline(), lambda: True, take_fingerprint=True,
                                                  extra={1: shard(1)}, splits={1: [2, 0]})
                       for pod in pods}
            got = {p: f.result(timeout=5 * DEADLINE_S)[0] for p, f in futures.items()}
    finally:
        for pod in pods:
            pod.close()
        listeners[1].close()
    for outcome in got.values():
        assert (outcome.checksum, outcome.fingerprint) == (healthy[0].checksum, healthy[0].fingerprint)
    assert got[0].shards[1] == (1, healthy[1].loss_sum, healthy[1].z_loss_sum, healthy[1].tokens)
    assert [s[0] for s in got[2].shards] == [None]      # its half of slot 1 went on to pod 0
