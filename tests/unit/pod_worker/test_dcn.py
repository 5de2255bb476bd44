"""The DCN exchange over the real ZeroMQ data plane in this process: N-pod sums bit for bit, leaf
order, compression, bad chunks, peers that stop, the slow-link pacer."""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
import zmq

from multipod import protos
from multipod.pod_worker.dcn import (
    BLOCK,
    PHASE_REDUCE,
    PHASE_WHOLE,
    Exchange,
    ExchangeError,
    LeafSpec,
    Listener,
    Pacer,
    Plan,
    WireCodec,
)
from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.transport import DATA, HEADER
from multipod.pod_worker.schema import DcnConfig, dcn as dcn_schema

RUN = "test-run"
SECRET = "correct-horse-battery-staple-42"
# Small chunks so that leaves span several chunks; one leaf smaller than the pod count.
CHUNK = 64
LEAVES = [LeafSpec((5, 7), np.dtype(np.float32)), LeafSpec((3,), np.dtype(np.float32)),
          LeafSpec((40,), np.dtype(np.float32)), LeafSpec((2, 3, 11), np.dtype(np.float32)),
          LeafSpec((700,), np.dtype(np.float32))]


class Pods:
    """n pods on loopback: each a data-plane Listener with an Exchange attached."""

    def __init__(self, n: int, timeout_s: float = 10.0, leaves=LEAVES, chunk=CHUNK, **kwargs):
        self.listeners = [Listener(i, "127.0.0.1:0", SECRET, curve=kwargs.get("encrypt", False)) for i in range(n)]
        self.addresses = [lst.address for lst in self.listeners]
        self.exchanges = [Exchange(RUN, i, self.addresses, leaves, self.listeners[i], chunk_bytes=chunk,
                                   timeout_s=timeout_s, secret=SECRET, **kwargs) for i in range(n)]

    def all_reduce(self, step: int, grads: list[list[np.ndarray]], **kwargs):
        """Every pod's all_reduce at once; returns [(summed leaves, stats)] by pod."""
        for ex in self.exchanges:
            ex.inbox.set_next_step(step)
        with concurrent.futures.ThreadPoolExecutor(len(self.exchanges)) as pool:
            futures = [pool.submit(ex.all_reduce, step, g, **kwargs) for ex, g in zip(self.exchanges, grads)]
            return [f.result(timeout=60) for f in futures]

    def close(self):
        for ex in self.exchanges:
            ex.close()
        for lst in self.listeners:
            lst.close()


@pytest.fixture
def pods_factory():
    made = []

    def make(n, **kwargs):
        pods = Pods(n, **kwargs)
        made.append(pods)
        return pods
    yield make
    for pods in made:
        pods.close()


def gradients(n: int, seed: int = 0, leaves=LEAVES) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(l.shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for l in leaves]
            for _ in range(n)]


def pod_order_sum(grads: list[list[np.ndarray]]) -> list[np.ndarray]:
    out = []
    for i in range(len(grads[0])):
        total = grads[0][i].copy()
        for g in grads[1:]:
            total = total + g[i]
        out.append(total)
    return out


def decoded(plan: Plan, leaf: int, values: np.ndarray, start: int, stop: int) -> np.ndarray:
    """What every pod makes of values [start, stop) of `leaf` after the wire: chunk by chunk."""
    out = np.empty(stop - start, np.float32)
    for a, b in plan.chunks(leaf, start, stop):
        plan.codec.decode_into(plan.codec.encode(values[a - start:b - start]), out[a - start:b - start])
    return out


def compressed_reference(grads, compression: str) -> list[np.ndarray]:
    """A numpy model of the exchange with lossy transport: pod-order sums of decoded values."""
    n = len(grads)
    plan = Plan(n, LEAVES, CHUNK, compression)
    out = []
    for i, spec in enumerate(LEAVES):
        flat = [g[i].reshape(-1) for g in grads]
        if n == 2:
            total = decoded(plan, i, flat[0], 0, spec.size) + decoded(plan, i, flat[1], 0, spec.size)
        else:
            total = np.empty(spec.size, np.float32)
            for a, b in plan.ranges[i]:
                parts = [decoded(plan, i, f[a:b], a, b) for f in flat]
                reduced = parts[0] + parts[1]
                for p in parts[2:]:
                    reduced = reduced + p
                total[a:b] = decoded(plan, i, reduced, a, b)
        out.append(total.reshape(spec.shape))
    return out


def assert_bitwise(a: np.ndarray, b: np.ndarray):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.parametrize("cpus,links", [(2, 1), (8, 4)])
def test_auto_streams_open_one_link_per_two_cpus_and_sum_alike(pods_factory, monkeypatch, cpus, links):
    """dcn.streams = "auto" (the default) on a host of `cpus` CPUs: that many links per peer, and the
    same bitwise pod-order sum as an explicit count."""
    monkeypatch.setattr(dcn_schema, "this_host_cpus", lambda: cpus)
    pods = pods_factory(3, dcn=DcnConfig(chunk_bytes=protos.MIN_CHUNK_BYTES, timeout_s=10.0))
    assert [sorted(len(ls) for ls in ex.outbox._links.values()) for ex in pods.exchanges] == [[links, links]] * 3
    grads = gradients(3, seed=5)
    for summed, _ in pods.all_reduce(0, grads):
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)


@pytest.mark.parametrize("num_pods,streams", [(2, 1), (2, 3), (3, 1), (4, 2)])
def test_float32_sum_equals_pod_order_reference_to_the_bit(pods_factory, num_pods, streams):
    pods = pods_factory(num_pods, streams=streams)
    for step in range(2):     # two steps: per-step state is dropped and rebuilt
        grads = gradients(num_pods, seed=step)
        expected = pod_order_sum(grads)
        results = pods.all_reduce(step, grads)
        for summed, stats in results:
            for got, want in zip(summed, expected):
                assert_bitwise(np.asarray(got), want)
            assert stats.bytes_sent > 0 and stats.bytes_received > 0
    # 2 pods send the whole gradient; N pods send 2 (N - 1) / N of it (reduce-scatter + all-gather).
    total = sum(l.nbytes for l in LEAVES)
    sent = [s.bytes_sent for _, s in results]
    if num_pods == 2:
        assert sent == [total, total]
    else:
        assert sum(sent) == 2 * (num_pods - 1) * total
    assert all(lst.refused == 0 for lst in pods.listeners)


class Lazy:
    """A leaf that records when it is read (as the trainer's device arrays are: on np.asarray)."""

    def __init__(self, value: np.ndarray, log: list, index: int):
        self.value, self.log, self.index = value, log, index

    def __array__(self, dtype=None, copy=None):
        self.log.append(self.index)
        return self.value


@pytest.mark.parametrize("num_pods", [2, 3])
def test_leaves_are_read_one_at_a_time_in_the_given_order(pods_factory, num_pods):
    pods = pods_factory(num_pods)
    grads = gradients(num_pods, seed=5)
    order = list(range(len(LEAVES)))[::-1]      # the last layer's leaves first, as backward makes them
    logs = [[] for _ in range(num_pods)]
    lazy = [[Lazy(g, logs[p], i) for i, g in enumerate(grads[p])] for p in range(num_pods)]
    seen = [[] for _ in range(num_pods)]
    results = pods.all_reduce(0, lazy, order=order,
                              on_leaf=None)
    for p in range(num_pods):
        assert logs[p] == order           # each leaf read once, when its turn came
    for summed, _ in results:             # results by leaf index, whatever the order
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)
    # on_leaf sees the leaves in the given order.
    for ex in pods.exchanges:
        ex.inbox.set_next_step(1)
    with concurrent.futures.ThreadPoolExecutor(num_pods) as pool:
        futures = [pool.submit(ex.all_reduce, 1, grads[p], lambda i, v, p=p: seen[p].append(i) or v, order)
                   for p, ex in enumerate(pods.exchanges)]
        [f.result(timeout=60) for f in futures]
    assert all(s == order for s in seen)
    with pytest.raises(ValueError, match="permutation"):
        pods.exchanges[0].all_reduce(2, grads[0], order=[0, 0, 1, 2, 3])


def test_two_pods_sum_exactly_whether_chunks_arrive_before_or_after_own_values(pods_factory):
    # Pod 1 sends its whole gradient before pod 0 starts: pod 0 adds its own values after the
    # fact, pod 1 adds each arriving chunk at once. Both must give the pod-order sum.
    pods = pods_factory(2, streams=2)
    grads = gradients(2, seed=11)
    expected = pod_order_sum(grads)
    for ex in pods.exchanges:
        ex.inbox.set_next_step(0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = pool.submit(pods.exchanges[1].all_reduce, 0, grads[1])
        slot = pods.exchanges[0].inbox.state(0).slots[(PHASE_WHOLE, 1)]
        wait_for(lambda: not any(slot.missing), 30)
        assert sum(len(r) for r in slot.unfused) > 0     # the after-the-fact path is exercised
        first, _ = pods.exchanges[0].all_reduce(0, grads[0])
        second, _ = late.result(timeout=30)
    for summed in (first, second):
        for got, want in zip(summed, expected):
            assert_bitwise(np.asarray(got), want)


def test_a_different_summation_order_would_be_detected():
    # Guards the reference above: float32 addition order matters for these values.
    grads = gradients(4)
    forward = pod_order_sum(grads)
    backward = pod_order_sum(grads[::-1])
    assert any(a.tobytes() != b.tobytes() for a, b in zip(forward, backward))


@pytest.mark.parametrize("compression", ["bf16", "int8"])
@pytest.mark.parametrize("num_pods", [2, 3, 4])
def test_compressed_sums_equal_the_decoded_reference_on_every_pod(pods_factory, compression, num_pods):
    pods = pods_factory(num_pods, compression=compression)
    grads = gradients(num_pods, seed=7)
    results = pods.all_reduce(0, grads)
    reference = compressed_reference(grads, compression)
    for summed, _ in results:
        for got, want in zip(summed, reference):
            assert_bitwise(np.asarray(got), want)
    exact = pod_order_sum(grads)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(reference, exact)), "compression changed nothing"
    # The wire bytes shrink with the encoding (int8: plus one float32 scale per block).
    plan = Plan(num_pods, LEAVES, CHUNK, compression)
    per_pod = sum(plan.payload_bytes(i, b - a)
                  for i in range(len(LEAVES)) for a, b in plan.chunks(i, 0, LEAVES[i].size))
    wire = sum(s.bytes_sent for _, s in results)
    if num_pods == 2:
        assert wire == 2 * per_pod
    else:
        full = sum(l.nbytes for l in LEAVES) * 2 * (num_pods - 1)
        assert wire == full // 2 if compression == "bf16" else full // 4 < wire < full // 3


def test_int8_carries_one_scale_per_block_of_at_most_256_values():
    codec = WireCodec("int8")
    values = np.random.default_rng(3).standard_normal(3 * BLOCK + 17).astype(np.float32) * 1e-3
    values[5] = 1e3                       # one huge value spoils only its own block's precision
    payload = codec.encode(values)
    blocks = -(-values.size // BLOCK)
    assert payload.nbytes == values.size + 4 * blocks == codec.nbytes(values.size, np.dtype(np.float32))
    scales = payload[:4 * blocks].view("<f4")
    for b in range(blocks):
        block = values[b * BLOCK:(b + 1) * BLOCK]
        assert scales[b] == np.float32(np.abs(block).max()) / np.float32(127)
    out = np.empty_like(values)
    codec.decode_into(payload, out)
    rest = slice(BLOCK, None)
    assert np.all(np.abs(out[rest] - values[rest]) <= np.repeat(scales[1:], BLOCK)[:values.size - BLOCK] / 2 * 1.01)
    assert np.abs(out[rest] - values[rest]).max() < 1e-4   # one scale per chunk would have lost them all


def test_int8_non_finite_gradient_gives_non_finite_sum_on_every_pod(pods_factory):
    pods = pods_factory(2, compression="int8")
    grads = gradients(2)
    grads[1][2][3] = np.inf
    results = pods.all_reduce(0, grads)
    assert not np.all(np.isfinite(np.asarray(results[0][0][2])))
    assert_bitwise(np.asarray(results[0][0][2]), np.asarray(results[1][0][2]))


def test_wire_codecs_round_trip_on_the_sender_as_on_the_receiver():
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    for name in ("none", "bf16", "int8"):
        c = WireCodec(name)
        payload = c.encode(values)
        mine, theirs = np.empty_like(values), np.empty_like(values)
        c.decode_into(payload, mine)
        c.decode_into(payload.tobytes(), theirs)
        assert_bitwise(mine, theirs)
        assert np.abs(mine - values).max() <= (0 if name == "none" else 0.05)
    with pytest.raises(ValueError, match="compression"):
        WireCodec("fp4")


# -- bad chunks, from a peer that did prove the secret ----------------------------------------------
def authenticated(address: str, pod: int, peer: int, secret: str = SECRET, run: str = RUN) -> Connection:
    """A connection to `address` that completed the handshake as `pod` (the caller closes it)."""
    conn = Connection(zmq.Context.instance(), address, pod, peer, run, secret)
    conn.handshake(time.monotonic() + 10)
    return conn


def send_chunk(conn: Connection, payload: bytes, **fields) -> None:
    header = dict(version=protos.PROTOCOL_VERSION, pod=1, step=0, phase=PHASE_WHOLE, leaf=2, offset=0)
    header.update(fields)
    conn.socket.send_multipart([DATA, HEADER.pack(*header.values()), payload])


GOOD = np.ones(16, np.float32).tobytes()


@pytest.mark.parametrize("bad,payload,message", [
    (dict(step=7), GOOD, "step 7"),
    (dict(leaf=99), GOOD, "leaf 99 out of range"),
    (dict(offset=4), GOOD, "grid"),
    (dict(), b"\0" * 12, "bytes"),
    (dict(pod=0), GOOD, "claiming pod 0"),
    (dict(phase=PHASE_REDUCE), GOOD, "phase"),
    (dict(version=999), GOOD, "protocol version"),
])
def test_bad_chunk_is_refused_and_the_step_is_unharmed(pods_factory, bad, payload, message):
    assert_refused_and_step_unharmed(pods_factory(2), lambda conn: send_chunk(conn, payload, **bad), message,
                                     gradients(2, seed=3))


def assert_refused_and_step_unharmed(pods: Pods, send, message: str, grads) -> None:
    """Pod 1 sends pod 0 what `send(connection)` sends, on an authenticated connection of its
    own: pod 0 refuses it, naming `message`, and the real exchange of step 0 (of `grads`) still
    gives the exact sum on both pods."""
    pods.exchanges[0].inbox.set_next_step(0)
    listener = pods.listeners[0]
    conn = authenticated(pods.addresses[0], 1, 0)
    try:
        send(conn)
        wait_for(lambda: listener.refused >= 1)
    finally:
        conn.close()
    assert message in listener.refusals[-1]
    for summed, _ in pods.all_reduce(0, grads):
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)


def test_duplicate_chunk_is_refused_and_does_not_overwrite(pods_factory):
    pods = pods_factory(2)
    inbox = pods.exchanges[0].inbox
    inbox.set_next_step(0)
    conn = authenticated(pods.addresses[0], 1, 0)
    try:
        send_chunk(conn, GOOD)
        send_chunk(conn, np.full(16, 9, np.float32).tobytes())
        wait_for(lambda: pods.listeners[0].refused >= 1)
    finally:
        conn.close()
    assert "duplicate" in pods.listeners[0].refusals[-1]
    slot = inbox.state(0).slots[(PHASE_WHOLE, 1)]
    assert np.all(slot.targets[2][:16] == 1.0)


# -- peers that stop -----------------------------------------------------------------------------
def _partial(conn: Connection, chunks: int) -> None:
    """Pod 1's gradient for step 0, but only its first `chunks` chunks."""
    plan = Plan(2, LEAVES, CHUNK, "none")
    sent = 0
    for i, spec in enumerate(LEAVES):
        for a, b in plan.chunks(i, 0, spec.size):
            if sent == chunks:
                return
            send_chunk(conn, np.ones(b - a, np.float32).tobytes(), leaf=i, offset=a)
            sent += 1


def test_peer_that_dies_mid_leaf_fails_the_step_quickly(pods_factory):
    timeout = 20.0
    pods = pods_factory(2, timeout_s=timeout)
    pod0 = pods.exchanges[0]
    pod0.inbox.set_next_step(0)
    conn = authenticated(pods.addresses[0], 1, 0)
    _partial(conn, 3)       # leaf 0 spans 3 chunks: the peer dies in the middle of leaf 1's stream
    slot = pod0.inbox.state(0).slots[(PHASE_WHOLE, 1)]
    wait_for(lambda: slot.bytes > 0)
    start = time.monotonic()
    conn.close()            # the peer goes away mid-step
    with pytest.raises(ExchangeError, match=r"pod 1: its data-plane connection closed after \d+ bytes"):
        pod0.all_reduce(0, gradients(2)[0])
    assert time.monotonic() - start < timeout / 2   # from the broken connection, not the deadline


def test_peer_that_stalls_mid_leaf_fails_the_step_at_the_deadline(pods_factory):
    timeout = 1.5
    pods = pods_factory(2, timeout_s=timeout)
    pod0 = pods.exchanges[0]
    pod0.inbox.set_next_step(0)
    conn = authenticated(pods.addresses[0], 1, 0)
    try:
        _partial(conn, 4)
        start = time.monotonic()
        with pytest.raises(ExchangeError, match=r"gradient from pod 1 \(\d+ of its bytes so far.*DCN deadline"):
            pod0.all_reduce(0, gradients(2)[0])
        assert time.monotonic() - start < timeout + 5.0
    finally:
        conn.close()


def test_sending_to_a_dead_peer_fails_the_step_naming_it(pods_factory):
    timeout = 5.0
    pods = pods_factory(2, timeout_s=timeout)
    pods.exchanges[1].close()
    pods.listeners[1].close()
    pods.exchanges[0].inbox.set_next_step(0)
    start = time.monotonic()
    with pytest.raises(ExchangeError, match="pod 1"):
        pods.exchanges[0].all_reduce(0, gradients(2)[0])
    assert time.monotonic() - start < timeout + 5.0


# -- slow-link mode ------------------------------------------------------------------------------
def test_pacer_never_lets_bytes_through_faster_than_the_link():
    pacer = Pacer(gbps=8e-3, latency_s=0.05, burst_bytes=0)     # 1 MB/s, 50 ms
    start = time.monotonic()
    for _ in range(4):
        pacer.wait(50_000, time.monotonic())
    assert time.monotonic() - start >= 0.2 * 0.99    # 200 KB at 1 MB/s
    assert not Pacer().active and Pacer(latency_s=0.001).active


def test_slow_link_exchange_still_sums_exactly(pods_factory):
    pods = pods_factory(2, link_gbps=0.01, link_latency_ms=5.0)
    grads = gradients(2)
    expected = pod_order_sum(grads)
    for summed, _stats in pods.all_reduce(0, grads):
        for got, want in zip(summed, expected):
            assert_bitwise(np.asarray(got), want)


def test_encrypted_exchange_sums_exactly_and_refuses_plain_peers(pods_factory):
    pods = pods_factory(3, encrypt=True)
    assert all(a.startswith("curve://") for a in pods.addresses)
    grads = gradients(3, seed=2)
    for summed, _ in pods.all_reduce(0, grads):
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)
    from multipod.model import ConfigError
    plain = Listener(0, "127.0.0.1:0", SECRET)
    try:
        with pytest.raises(ConfigError, match="dcn.encrypt"):
            Exchange(RUN, 0, [plain.address, pods.addresses[1]], LEAVES, plain, encrypt=True, secret=SECRET)
    finally:
        plain.close()


@pytest.mark.parametrize("num_pods", [2, 3])
def test_waiting_on_a_late_pod_is_told_apart_from_waiting_on_the_link(pods_factory, num_pods):
    # Pod 0 starts its exchange only once every peer's first chunk has reached it. The peers wait
    # on pod 0 from their first wait until its chunks come: that is peer_wait_s, part of idle_s.
    # Pod 0 itself never waits on a pod that has not begun: its peer_wait_s is 0.
    late_by = 0.5
    pods = pods_factory(num_pods, streams=1)
    grads = gradients(num_pods, seed=5)
    for ex in pods.exchanges:
        ex.inbox.set_next_step(0)

    def timed(p):
        start = time.monotonic()
        summed, stats = pods.exchanges[p].all_reduce(0, grads[p])
        return summed, stats, start, time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(num_pods) as pool:
        early = {p: pool.submit(timed, p) for p in range(1, num_pods)}
        time.sleep(late_by)
        state = pods.exchanges[0].inbox.state(0)
        wait_for(lambda: len(state.first_chunk_at) == num_pods - 1, 30)
        summed0, stats0, late_start, _ = timed(0)
        results = {p: f.result(timeout=60) for p, f in early.items()}
    assert stats0.peer_wait_s == 0.0 and stats0.idle_s >= 0.0
    for p, (summed, stats, start, wall) in results.items():
        # It began waiting at most `wall - idle_s` (its own work) after its start; pod 0 sent
        # nothing before late_start.
        busy = wall - stats.idle_s
        assert stats.peer_wait_s <= stats.idle_s
        assert stats.peer_wait_s >= min(stats.idle_s, late_start - start - busy) > 0, (p, stats, wall)
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)
