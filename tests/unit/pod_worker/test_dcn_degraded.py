"""Degraded mode of the DCN exchange, over the real data plane in this process: live pods compute
failed pods' slots, and every live pod's sum is bitwise the healthy exchange's (2 pods and N > 2,
every compression); chunks of a slot from a pod that does not host it are refused; the extra
slots must match the hosts; abort() ends a waiting step at once."""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from multipod.pod_worker.dcn import PHASE_REDUCE, PHASE_SLOT_BASE, Exchange, ExchangeError, LeafSpec, Listener, Plan
from multipod.pod_worker.dcn.collectives import SlotGather
from tests.unit.pod_worker.test_dcn import SECRET, Lazy, assert_bitwise, authenticated, send_chunk, wait_for

# Odd sizes; 600 bytes per chunk: 150 float32, 300 bf16 or 600 int8 values, so that leaves span
# several chunks, owners' slices cut chunks short, and int8 chunks end in partial blocks.
CHUNK = 600
LEAVES = [LeafSpec((5, 7), np.dtype(np.float32)), LeafSpec((3,), np.dtype(np.float32)),
          LeafSpec((2, 3, 11), np.dtype(np.float32)), LeafSpec((1013,), np.dtype(np.float32)),
          LeafSpec((37, 61), np.dtype(np.float32)), LeafSpec((4099,), np.dtype(np.float32))]

ASSIGNMENTS = {
    2: [(0, 0), (1, 1)],
    3: [(0, 0, 2), (0, 1, 1), (2, 2, 2)],
    4: [(0, 1, 2, 2), (0, 0, 2, 2), (0, 1, 1, 1), (3, 3, 3, 3)],
}


def slot_gradients(n: int, seed: int = 0) -> list[list[np.ndarray]]:
    """Each slot's gradient leaves; magnitudes vary within a leaf so int8 blocks differ."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        leaves = []
        for spec in LEAVES:
            scale = 10.0 ** rng.integers(-4, 3, size=spec.shape)
            leaves.append((rng.standard_normal(spec.shape) * scale).astype(np.float32))
        out.append(leaves)
    return out


class Cluster:
    """n pods' listeners on loopback; exchanges are built per run, for the live pods only."""

    def __init__(self, n: int):
        self.listeners = [Listener(i, "127.0.0.1:0", SECRET) for i in range(n)]
        self.addresses = [lst.address for lst in self.listeners]
        self.n = n

    def exchanges(self, run: str, hosts=None, compression="none", timeout_s=30.0) -> dict[int, Exchange]:
        live = sorted(set(hosts)) if hosts is not None else range(self.n)
        return {p: Exchange(run, p, self.addresses, LEAVES, self.listeners[p], chunk_bytes=CHUNK,
                            timeout_s=timeout_s, compression=compression, secret=SECRET,
                            hosts=list(hosts) if hosts is not None else None) for p in live}

    def run(self, run: str, grads, hosts=None, compression="none", step=0, **kwargs):
        """One step on every live pod; {pod: (summed leaves, stats)}."""
        exchanges = self.exchanges(run, hosts, compression)
        try:
            return run_step(exchanges, grads, hosts, step, **kwargs)
        finally:
            for ex in exchanges.values():
                ex.close()

    def close(self):
        for lst in self.listeners:
            lst.close()


def run_step(exchanges: dict[int, Exchange], grads, hosts, step=0, **kwargs):
    for ex in exchanges.values():
        ex.inbox.set_next_step(step)
    with concurrent.futures.ThreadPoolExecutor(len(exchanges)) as pool:
        futures = {}
        for p, ex in exchanges.items():
            extra = {s: grads[s] for s, h in enumerate(hosts) if h == p and s != p} if hosts else None
            futures[p] = pool.submit(ex.all_reduce, step, grads[p], extra=extra, **kwargs)
        return {p: f.result(timeout=60) for p, f in futures.items()}


@pytest.fixture
def cluster_factory():
    made = []

    def make(n):
        made.append(Cluster(n))
        return made[-1]
    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("compression", ["none", "bf16", "int8"])
@pytest.mark.parametrize("num_pods", [2, 3, 4])
def test_degraded_sum_is_bitwise_the_healthy_sum_on_every_live_pod(cluster_factory, num_pods, compression):
    cluster = cluster_factory(num_pods)
    grads = slot_gradients(num_pods, seed=num_pods)
    healthy = cluster.run("healthy", grads, compression=compression)
    reference = healthy[0][0]
    for summed, _ in healthy.values():
        for got, want in zip(summed, reference):
            assert_bitwise(np.asarray(got), np.asarray(want))
    plan = Plan(num_pods, LEAVES, CHUNK, compression, ASSIGNMENTS[num_pods][0])
    for k, hosts in enumerate(ASSIGNMENTS[num_pods]):
        results = cluster.run(f"degraded-{k}", grads, hosts=hosts, compression=compression)
        assert sorted(results) == sorted(set(hosts))
        for pod, (summed, stats) in results.items():
            for i, (got, want) in enumerate(zip(summed, reference)):
                assert got.shape == LEAVES[i].shape
                assert_bitwise(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
            # Each slot of another live pod arrives whole, on the slot grid; nothing from a failed pod.
            remote = sum(1 for h in hosts if h != pod)
            per_slot = sum(plan.payload_bytes(i, b - a) for i in range(len(LEAVES)) for a, b in plan.slot_grid(i))
            assert stats.bytes_received == remote * per_slot
            peers = len(set(hosts)) - 1
            assert stats.bytes_sent == peers * hosts.count(pod) * per_slot
    assert all(lst.refused == 0 for lst in cluster.listeners)


def test_the_slot_grid_is_what_makes_int8_exact():
    # Guards the test above: encoding a slot on the whole-leaf grid (not the owners' slices)
    # would change the int8 values of N > 2 pods, so the bitwise check means something.
    plan = Plan(3, LEAVES, CHUNK, "int8", (0, 1, 1))
    values = slot_gradients(1, seed=9)[0][5].reshape(-1)

    def decoded(grid):
        out = np.empty_like(values)
        for a, b in grid:
            plan.codec.decode_into(plan.codec.encode(values[a:b]), out[a:b])
        return out
    assert decoded(plan.slot_grid(5)).tobytes() != decoded(plan.chunks(5, 0, values.size)).tobytes()
    assert plan.slot_grid(5)[0] == (0, 600) and (1366, 1966) in plan.slot_grid(5)


def test_identity_hosts_is_the_healthy_exchange(cluster_factory):
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("identity", hosts=[0, 1, 2])
    try:
        assert not any(isinstance(ex.collective, SlotGather) for ex in exchanges.values())
        assert all(not ex.plan.degraded for ex in exchanges.values())
    finally:
        for ex in exchanges.values():
            ex.close()


def test_failed_pods_are_never_connected_to_and_leaves_are_read_in_order(cluster_factory):
    cluster = cluster_factory(4)
    grads = slot_gradients(4, seed=4)
    reference = cluster.run("healthy", grads, compression="int8")[0][0]
    hosts = (0, 0, 2, 2)
    for dead in (1, 3):         # gone for good: their addresses lead nowhere
        cluster.listeners[dead].close()
    exchanges = cluster.exchanges("degraded", hosts=hosts, compression="int8")
    try:
        assert {p: sorted(ex.outbox._links) for p, ex in exchanges.items()} == {0: [2], 2: [0]}
        order = list(range(len(LEAVES)))[::-1]
        logs = {s: [] for s in range(4)}
        lazy = [[Lazy(g, logs[s], i) for i, g in enumerate(grads[s])] for s in range(4)]
        seen = {p: [] for p in exchanges}
        for ex in exchanges.values():
            ex.inbox.set_next_step(0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {p: pool.submit(ex.all_reduce, 0, lazy[p], lambda i, v, p=p: seen[p].append(i) or v, order,
                                      extra={p + 1: lazy[p + 1]}) for p, ex in exchanges.items()}
            results = {p: f.result(timeout=60) for p, f in futures.items()}
    finally:
        for ex in exchanges.values():
            ex.close()
    assert all(log == order for log in logs.values())     # each slot's leaf read once, when its turn came
    assert seen == {0: order, 2: order}
    for summed, _ in results.values():
        for got, want in zip(summed, reference):
            assert_bitwise(np.asarray(got), np.asarray(want))


# -- refusals and misuse --------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(pod=2, phase=PHASE_SLOT_BASE + 3), "slot 3 is computed by pod 0, not by pod 2"),
    (dict(pod=3, phase=PHASE_SLOT_BASE + 3), "pod 3 is not taking part"),
    (dict(pod=0, phase=PHASE_SLOT_BASE + 0, offset=4), "not on the chunk grid of slot 0"),
    (dict(pod=0, phase=PHASE_SLOT_BASE + 3, offset=300), "not on the chunk grid of slot 3"),   # slices restart it
    (dict(pod=0, phase=PHASE_REDUCE), "phase 1 is not used"),
])
def test_a_slot_chunk_from_a_pod_that_does_not_host_it_is_refused_and_writes_nothing(cluster_factory, fields,
                                                                                       message):
    cluster = cluster_factory(4)
    hosts = (0, 1, 2, 0)        # pod 3 failed; pod 0 computes its slot
    grads = slot_gradients(4, seed=1)
    reference = cluster.run("healthy", grads)[0][0]
    exchanges = cluster.exchanges("degraded", hosts=hosts)
    try:
        inbox = exchanges[1].inbox
        inbox.set_next_step(0)
        slot = inbox.state(0).slots[(PHASE_SLOT_BASE + 3, 0)]
        before = [t.copy() for t in slot.targets]
        conn = authenticated(cluster.addresses[1], fields["pod"], 1, run="degraded")
        try:
            # Leaf 3's first chunk: 150 float32 values (the owners' slices of 1013 are 253 long).
            send_chunk(conn, np.full(150, 7, np.float32).tobytes(), **dict(dict(leaf=3, offset=0), **fields))
            wait_for(lambda: cluster.listeners[1].refused >= 1)
        finally:
            conn.close()
        assert message in cluster.listeners[1].refusals[-1]
        assert all(not seen for seen in slot.seen) and slot.bytes == 0
        assert all(a.tobytes() == b.tobytes() for a, b in zip(before, slot.targets))
        results = run_step(exchanges, grads, hosts)      # the real step is unharmed
    finally:
        for ex in exchanges.values():
            ex.close()
    for summed, _ in results.values():
        for got, want in zip(summed, reference):
            assert_bitwise(np.asarray(got), np.asarray(want))


def test_extra_slots_must_match_the_hosts(cluster_factory):
    cluster = cluster_factory(3)
    grads = slot_gradients(3)
    exchanges = cluster.exchanges("degraded", hosts=(0, 1, 0))
    healthy = cluster.exchanges("healthy")
    try:
        for extra in (None, {}, {1: grads[1]}, {2: grads[2], 1: grads[1]}):
            with pytest.raises(ValueError, match=r"extra slots \[2\]"):
                exchanges[0].all_reduce(0, grads[0], extra=extra)
        with pytest.raises(ValueError, match=r"extra slots \[\]"):
            exchanges[1].all_reduce(0, grads[1], extra={2: grads[2]})
        with pytest.raises(ValueError, match=r"extra slots \[\]"):
            healthy[0].all_reduce(0, grads[0], extra={1: grads[1]})
        with pytest.raises(ValueError, match="extra slot 2: 2 leaves"):
            exchanges[0].all_reduce(0, grads[0], extra={2: grads[2][:2]})
    finally:
        for ex in [*exchanges.values(), *healthy.values()]:
            ex.close()


@pytest.mark.parametrize("hosts,pod,message", [
    ((0, 1), 0, "a pod"),                                   # too short for 3 pods
    ((0, 1, 3), 0, r"in \[0, 3\)"),
    ((1, 1, 0), 0, "must compute its own slot"),
    ((0, 0, 0), 1, "pod 1 is not among the hosts"),
])
def test_hosts_that_do_not_fit_are_refused(cluster_factory, hosts, pod, message):
    cluster = cluster_factory(3)
    with pytest.raises(ValueError, match=message):
        Exchange("bad", pod, cluster.addresses, LEAVES, cluster.listeners[pod], secret=SECRET, hosts=list(hosts))


# -- abort ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hosts", [None, (0, 1, 0)])
@pytest.mark.parametrize("how", ["abort", "close"])
def test_abort_fails_a_waiting_step_at_once(cluster_factory, hosts, how):
    cluster = cluster_factory(3)
    grads = slot_gradients(3)
    exchanges = cluster.exchanges("stuck", hosts=hosts, timeout_s=60.0)
    ex = exchanges[0]
    try:
        ex.inbox.set_next_step(0)
        extra = {2: grads[2]} if hosts else None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Pod 1 hangs (never calls all_reduce): pod 0 waits for its gradient.
            waiting = pool.submit(ex.all_reduce, 0, grads[0], extra=extra)
            time.sleep(0.3)
            assert not waiting.done()
            if how == "abort":
                ex.abort("pod 1 hangs: the controller cut the step short")
            else:
                ex.close()
            error = waiting.exception(timeout=10)       # well before the 60 s deadline
        assert isinstance(error, ExchangeError)
        assert ("pod 1 hangs" if how == "abort" else "was closed") in str(error)
        with pytest.raises(ExchangeError):      # unusable afterwards
            ex.all_reduce(0, grads[0], extra=extra)
    finally:
        for e in exchanges.values():
            e.close()
