"""The DCN exchange through real gRPC servers in this process: N-pod sums, compression, bad
chunks, peers that stop mid-stream, the slow-link pacer."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest

from multipod import protos
from multipod.pod_worker.dcn import PHASE_REDUCE, PHASE_WHOLE, Exchange, ExchangeError, LeafSpec, Pacer, Plan, WireCodec
from multipod.pod_worker.pod import Pod
from multipod.pod_worker.server import DcnService
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.transport import add_port, open_channel

RUN = "test-run"
# Small chunks so that leaves span several chunks; one leaf smaller than the pod count.
CHUNK = 64
LEAVES = [LeafSpec((5, 7), np.dtype(np.float32)), LeafSpec((3,), np.dtype(np.float32)),
          LeafSpec((40,), np.dtype(np.float32)), LeafSpec((2, 3, 11), np.dtype(np.float32))]


class Pods:
    """n Dcn servers (the real DcnService over a Pod), each with an Exchange, on loopback."""

    def __init__(self, n: int, timeout_s: float = 10.0, **kwargs):
        self.servers, self.services, addresses = [], [], []
        for i in range(n):
            server = grpc.server(concurrent.futures.ThreadPoolExecutor(16), options=protos.channel_options())
            service = Pod(i)
            pb_grpc.add_DcnServicer_to_server(DcnService(service), server)
            port = add_port(server, "127.0.0.1:0")
            server.start()
            self.servers.append(server)
            self.services.append(service)
            addresses.append(f"127.0.0.1:{port}")
        self.addresses = addresses
        for i, service in enumerate(self.services):
            service.exchange = Exchange(RUN, i, addresses, LEAVES, CHUNK, timeout_s, **kwargs)
        self.exchanges = [s.exchange for s in self.services]

    def all_reduce(self, step: int, grads: list[list[np.ndarray]]):
        """Every pod's all_reduce at once; returns [(summed leaves, stats)] by pod."""
        for ex in self.exchanges:
            ex.inbox.set_next_step(step)
        with concurrent.futures.ThreadPoolExecutor(len(self.exchanges)) as pool:
            futures = [pool.submit(ex.all_reduce, step, g) for ex, g in zip(self.exchanges, grads)]
            return [f.result(timeout=60) for f in futures]

    def close(self):
        for ex in self.exchanges:
            ex.close()
        for server in self.servers:
            server.stop(0)


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


def gradients(n: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(l.shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for l in LEAVES]
            for _ in range(n)]


def pod_order_sum(grads: list[list[np.ndarray]]) -> list[np.ndarray]:
    out = []
    for i in range(len(LEAVES)):
        total = grads[0][i].copy()
        for g in grads[1:]:
            total = total + g[i]
        out.append(total)
    return out


def assert_bitwise(a: np.ndarray, b: np.ndarray):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


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


def test_two_pods_sum_exactly_whether_chunks_arrive_before_or_after_own_values(pods_factory):
    # Pod 1 streams its whole gradient before pod 0 starts: pod 0 adds its own values after the
    # fact, pod 1 adds each arriving chunk at once. Both must give the pod-order sum.
    pods = pods_factory(2, streams=2)
    grads = gradients(2, seed=11)
    expected = pod_order_sum(grads)
    for ex in pods.exchanges:
        ex.inbox.set_next_step(0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = pool.submit(pods.exchanges[1].all_reduce, 0, grads[1])
        slot = pods.exchanges[0].inbox.state(0).slots[(PHASE_WHOLE, 1)]
        deadline = time.monotonic() + 30
        while any(slot.missing) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(slot.missing)
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
@pytest.mark.parametrize("num_pods", [2, 3])
def test_compressed_sums_are_identical_on_every_pod(pods_factory, compression, num_pods):
    pods = pods_factory(num_pods, compression=compression)
    grads = gradients(num_pods, seed=7)
    results = pods.all_reduce(0, grads)
    first = [np.asarray(x) for x in results[0][0]]
    for summed, _ in results[1:]:
        for got, want in zip(summed, first):
            assert_bitwise(np.asarray(got), want)
    exact = pod_order_sum(grads)
    lossy = any(a.tobytes() != b.tobytes() for a, b in zip(first, exact))
    assert lossy, "compression changed nothing: the test would not see it"
    for got, want, *per_pod in zip(first, exact, *grads):
        # Each value is rounded once as it leaves its pod and (N > 2) once more as a reduced
        # slice: bf16 rounds to 8 significant bits, int8 to half a step of the chunk's scale.
        bound = sum(np.abs(g).max() for g in per_pod) * (2 ** -7 if compression == "bf16" else 2 / 127)
        assert np.all(np.abs(got - want) <= bound + 1e-12)
    # The metrics' wire bytes shrink with the encoding.
    total = sum(l.nbytes for l in LEAVES)
    factor = {"bf16": 2, "int8": 4}[compression]
    wire = sum(s.bytes_sent for _, s in results)
    full = total * (2 if num_pods == 2 else 2 * (num_pods - 1))
    assert wire == full // factor


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
        wire, scale = c.encode(values)
        mine, theirs = np.empty_like(values), np.empty_like(values)
        c.decode_into(wire, scale, mine)
        c.decode_into(np.frombuffer(wire.tobytes(), wire.dtype), np.float32(scale).item(), theirs)
        assert_bitwise(mine, theirs)
    with pytest.raises(ValueError, match="compression"):
        WireCodec("fp4")


# -- bad chunks -----------------------------------------------------------------------------------
def _chunk(**overrides) -> pb.GradientChunk:
    fields = dict(protocol_version=protos.PROTOCOL_VERSION, run_id=RUN, from_pod=1, step=0, leaf_index=2,
                  dtype="float32", shape=[40], offset=0, data=np.ones(16, np.float32).tobytes(),
                  phase=PHASE_WHOLE)
    fields.update(overrides)
    return pb.GradientChunk(**fields)


@pytest.mark.parametrize("bad,message", [
    (dict(step=7), "step 7"),
    (dict(shape=[41]), "shape"),
    (dict(dtype="float16", data=np.ones(16, np.float16).tobytes()), "dtype"),
    (dict(dtype="complex64"), "dtype"),
    (dict(leaf_index=99), "leaf_index"),
    (dict(offset=4), "grid"),
    (dict(data=b"\0" * 12), "bytes"),
    (dict(from_pod=0), "not a peer"),
    (dict(run_id="other"), "run"),
    (dict(phase=PHASE_REDUCE), "phase"),
    (dict(protocol_version=999), "protocol"),
    (dict(scale=2.0), "scale"),
])
def test_bad_chunk_is_refused_and_the_step_is_unharmed(pods_factory, bad, message):
    pods = pods_factory(2)
    pods.exchanges[0].inbox.set_next_step(0)
    stub = pb_grpc.DcnStub(open_channel(pods.addresses[0]))
    with pytest.raises(grpc.RpcError) as info:
        stub.PushGradients(iter([_chunk(**bad), _chunk(last=True, data=b"")]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    # The real exchange of step 0 still gives the exact sum on both pods.
    grads = gradients(2, seed=3)
    expected = pod_order_sum(grads)
    for summed, _ in pods.all_reduce(0, grads):
        for got, want in zip(summed, expected):
            assert_bitwise(np.asarray(got), want)


def test_duplicate_chunk_is_refused_and_does_not_overwrite(pods_factory):
    pods = pods_factory(2)
    inbox = pods.exchanges[0].inbox
    inbox.set_next_step(0)
    stub = pb_grpc.DcnStub(open_channel(pods.addresses[0]))
    with pytest.raises(grpc.RpcError) as info:
        stub.PushGradients(iter([_chunk(), _chunk(data=np.full(16, 9, np.float32).tobytes()),
                                 _chunk(last=True, data=b"")]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "duplicate" in info.value.details()
    slot = inbox.state(0).slots[(PHASE_WHOLE, 1)]
    assert np.all(slot.targets[2][:16] == 1.0)


# -- peers that stop -----------------------------------------------------------------------------
def _partial_stream(stop: threading.Event, chunks: int):
    """Pod 1's gradient for step 0, but only its first `chunks` chunks; then it stalls until
    `stop` is set, and ends without the rest."""
    plan = Plan(2, LEAVES, CHUNK, "none")
    sent = 0
    for i, spec in enumerate(LEAVES):
        for _, a, b in plan.chunks(i, 0, spec.size):
            if sent == chunks:
                stop.wait(30)
                return
            yield _chunk(leaf_index=i, shape=list(spec.shape), offset=a * 4,
                         data=np.ones(b - a, np.float32).tobytes())
            sent += 1


def test_peer_that_breaks_off_mid_stream_fails_the_step_quickly(pods_factory):
    timeout = 20.0
    pods = pods_factory(2, timeout_s=timeout)
    pod0 = pods.exchanges[0]
    pod0.inbox.set_next_step(0)
    pods.exchanges[1].inbox.set_next_step(0)
    stop = threading.Event()
    stub = pb_grpc.DcnStub(open_channel(pods.addresses[0]))
    call = stub.PushGradients.future(_partial_stream(stop, 3), timeout=60)
    start = time.monotonic()
    threading.Timer(0.5, call.cancel).start()       # the peer goes away mid-stream
    with pytest.raises(ExchangeError, match=r"pod 1: its stream broke off after \d+ bytes"):
        pod0.all_reduce(0, gradients(2)[0])
    stop.set()
    assert time.monotonic() - start < timeout / 2   # the error came from the broken stream, not the deadline


def test_peer_that_stalls_mid_stream_fails_the_step_at_the_deadline(pods_factory):
    timeout = 1.5
    pods = pods_factory(2, timeout_s=timeout)
    pod0 = pods.exchanges[0]
    pod0.inbox.set_next_step(0)
    pods.exchanges[1].inbox.set_next_step(0)
    stop = threading.Event()
    stub = pb_grpc.DcnStub(open_channel(pods.addresses[0]))
    call = stub.PushGradients.future(_partial_stream(stop, 3), timeout=60)
    start = time.monotonic()
    try:
        with pytest.raises(ExchangeError, match=r"gradient from pod 1 \(\d+ of its bytes so far.*DCN deadline"):
            pod0.all_reduce(0, gradients(2)[0])
        assert time.monotonic() - start < timeout + 5.0
    finally:
        stop.set()
        call.cancel()


def test_sending_to_a_dead_peer_fails_the_step_naming_it(pods_factory):
    pods = pods_factory(2, timeout_s=20.0)
    pods.servers[1].stop(0)
    pods.exchanges[0].inbox.set_next_step(0)
    start = time.monotonic()
    with pytest.raises(ExchangeError, match="pod 1"):
        pods.exchanges[0].all_reduce(0, gradients(2)[0])
    assert time.monotonic() - start < 10.0


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
