"""dcn.lossless: zstd-packed chunks unpack bit for bit, bad packed frames are refused without harm,
the N-pod sums stay bitwise what they are unpacked, and `auto` packs only while the link keeps the
pod waiting."""
from __future__ import annotations

import concurrent.futures

import ml_dtypes
import numpy as np
import pytest
import zstandard

from multipod import protos
from multipod.pod_worker.dcn import PHASE_WHOLE, LeafSpec
from multipod.pod_worker.dcn.packing import MIN_PACK_BYTES, PACKED_HEAD, LosslessPolicy, Packer, PackingError, unpack
from multipod.pod_worker.dcn.transport import HEADER, PACKED
from multipod.pod_worker.dcn.wire import WireCodec
from tests.unit.pod_worker.test_dcn import (
    assert_bitwise,
    assert_refused_and_step_unharmed,
    pod_order_sum,
    pods_factory,  # noqa: F401
    wait_for,
)

# Leaves big enough that their chunks are packed (MIN_PACK_BYTES), one too small to be.
CHUNK = 128 << 10
LEAVES = [LeafSpec((256, 300), np.dtype(np.float32)), LeafSpec((70_001,), np.dtype(np.float32)),
          LeafSpec((3,), np.dtype(np.float32))]


def gradient_like(n: int, seed: int = 0) -> np.ndarray:
    """Normal values of one scale, as a leaf's gradient is about: their exponent bytes repeat."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, -1)).astype(np.float32)


def gradients(num_pods: int, seed: int = 0) -> list[list[np.ndarray]]:
    return [[gradient_like(spec.size, seed * 10 + p * 3 + i).reshape(spec.shape) for i, spec in enumerate(LEAVES)]
            for p in range(num_pods)]


@pytest.mark.parametrize("compression,itemsize", [("none", 4), ("bf16", 2), ("int8", 1)])
def test_a_payload_unpacks_to_its_own_bytes(compression, itemsize):
    # What the outbox hands the packer: the wire codec's payload, shuffled by its value size.
    payload = WireCodec(compression).encode(gradient_like(100_003, seed=1))
    assert payload.dtype.itemsize == itemsize
    data = payload.reshape(-1).view(np.uint8)
    packed = Packer().pack(data, itemsize)
    assert packed is not None and len(packed) < 0.97 * data.nbytes
    assert unpack(packed, 1 << 22).tobytes() == data.tobytes()


def test_float32_gradients_pack_to_about_0_85_and_bf16_to_about_0_7():
    values = gradient_like(1 << 20, seed=2)
    f32 = values.view(np.uint8)
    bf16 = values.astype(ml_dtypes.bfloat16).view(np.uint8)
    packer = Packer()
    assert 0.75 < len(packer.pack(f32, 4)) / f32.nbytes < 0.92
    assert 0.55 < len(packer.pack(bf16, 2)) / bf16.nbytes < 0.8


def test_what_would_not_pack_smaller_goes_raw():
    packer = Packer()
    noise = np.random.default_rng(3).integers(0, 256, 1 << 18, dtype=np.uint8)
    assert packer.pack(noise, 1) is None                                   # random bytes: no gain
    assert packer.pack(np.zeros(MIN_PACK_BYTES // 2, np.uint8), 4) is None  # too small to bother
    assert packer.pack(np.zeros(MIN_PACK_BYTES + 2, np.uint8), 4) is None   # not whole values


def _packed(data: bytes, itemsize: int = 4, claimed: int | None = None, frame: bytes | None = None) -> bytes:
    frame = zstandard.ZstdCompressor(level=1).compress(data) if frame is None else frame
    return PACKED_HEAD.pack(itemsize, len(data) if claimed is None else claimed) + frame


@pytest.mark.parametrize("packed,message", [
    (b"\x04", "shorter than its head"),
    (_packed(b"\0" * 4096, itemsize=3), "3-byte values"),
    (_packed(b"\0" * 4096, claimed=1 << 30), "at most"),
    (_packed(b"\0" * 4096, claimed=2048), "holds 4096 bytes, its head says 2048"),
    (_packed(b"\0" * 4096, frame=b"not a zstd frame at all"), "does not unpack"),
    (_packed(b"\0" * 4096) + b"tail", "does not unpack"),
])
def test_a_bad_packed_payload_is_refused_before_it_is_unpacked(packed, message):
    with pytest.raises(PackingError, match=message):
        unpack(packed, 1 << 22)


@pytest.mark.parametrize("num_pods", [2, 3])
def test_packed_sums_are_bitwise_the_unpacked_ones_on_every_pod(pods_factory, num_pods):  # noqa: F811
    packed = pods_factory(num_pods, leaves=LEAVES, chunk=CHUNK, lossless="on")
    raw = pods_factory(num_pods, leaves=LEAVES, chunk=CHUNK, lossless="off")
    for step in range(2):
        grads = gradients(num_pods, seed=step)
        expected = pod_order_sum(grads)
        for pods in (packed, raw):
            for summed, stats in pods.all_reduce(step, grads):
                for got, want in zip(summed, expected):
                    assert_bitwise(np.asarray(got), want)
                assert stats.packed == (pods is packed)
    for outbox in [ex.outbox for ex in packed.exchanges]:
        wait_for(lambda o=outbox: o.packed_bytes[0] > 0)      # the links pack after all_reduce returns
        payload, wire = outbox.packed_bytes
        assert wire < 0.95 * payload
    assert all(ex.outbox.packed_bytes == (0, 0) for ex in raw.exchanges)
    assert all(lst.refused == 0 for lst in packed.listeners + raw.listeners)


def test_packed_bf16_sums_are_bitwise_the_unpacked_bf16_ones(pods_factory):  # noqa: F811
    grads = gradients(3, seed=4)
    sums = []
    for lossless in ("on", "off"):
        pods = pods_factory(3, leaves=LEAVES, chunk=CHUNK, compression="bf16", lossless=lossless)
        sums.append([[np.asarray(x) for x in summed] for summed, _ in pods.all_reduce(0, grads)])
    for on_pod, off_pod in zip(*sums):
        for a, b in zip(on_pod, off_pod):
            assert_bitwise(a, b)


def _short_chunk() -> bytes:
    """A packed payload that unpacks fine but holds 20,000 bytes, not a chunk's."""
    packed = Packer().pack(gradient_like(5000).view(np.uint8), 4)
    assert packed is not None
    return packed


@pytest.mark.parametrize("payload,message", [
    (_packed(b"\0" * 4096, claimed=1 << 30), "packed payload's head claims"),
    (_short_chunk(), "a chunk of 20000 bytes at offset 0, expected"),
])
def test_a_bad_packed_frame_is_refused_and_the_step_is_unharmed(pods_factory, payload, message):  # noqa: F811
    header = HEADER.pack(protos.PROTOCOL_VERSION, 1, 0, PHASE_WHOLE, 0, 0)
    assert_refused_and_step_unharmed(pods_factory(2, leaves=LEAVES, chunk=CHUNK, lossless="on"),
                                     lambda conn: conn.socket.send_multipart([PACKED, header, payload]),
                                     message, gradients(2, seed=5))


def test_auto_packs_while_the_pod_waits_on_the_link_and_stops_when_it_does_not():
    policy = LosslessPolicy("auto")
    for _ in range(LosslessPolicy.SETTLE):      # a run's first exchanges wait on compiling peers
        assert not policy.update(17_000_000, 5.0) and not policy.packing
    assert not policy.update(17_000_000, 0.05) and not policy.packing    # 50 ms: under 2x packing's cost
    assert policy.update(17_000_000, 0.5) and policy.packing              # the link kept it waiting
    assert not policy.update(17_000_000, 0.3) and policy.packing          # still waiting: keep packing
    # Short waits (packing may be what shortened them) stop it only when 8 come in a row.
    for _ in range(LosslessPolicy.OFF_AFTER - 1):
        assert not policy.update(17_000_000, 0.01) and policy.packing
    assert not policy.update(17_000_000, 0.2) and policy.packing          # a long wait: count again
    for _ in range(LosslessPolicy.OFF_AFTER - 1):
        assert not policy.update(17_000_000, 0.01) and policy.packing
    assert policy.update(17_000_000, 0.01) and not policy.packing         # the 8th short wait in a row
    assert not policy.update(1000, 5.0) and not policy.packing            # nothing worth packing
    fixed = [LosslessPolicy("on"), LosslessPolicy("off")]
    for waited in (0.0, 5.0):
        assert not any(p.update(17_000_000, waited) for p in fixed)
    assert [p.packing for p in fixed] == [True, False]


def test_auto_turns_packing_on_over_a_slow_link_and_the_sums_stay_exact(pods_factory):  # noqa: F811
    # 0.02 Gb/s: each pod's 0.37 MB take about 0.15 s on the (paced) link, far more than packing
    # them costs, so the first exchange the policy heeds (the third) turns packing on for the next.
    pods = pods_factory(2, leaves=LEAVES, chunk=CHUNK, link_gbps=0.02, lossless="auto")
    packed = []
    for step in range(4):
        grads = gradients(2, seed=step)
        for summed, stats in pods.all_reduce(step, grads):
            for got, want in zip(summed, pod_order_sum(grads)):
                assert_bitwise(np.asarray(got), want)
            packed.append(stats.packed)
    assert packed == [False] * 6 + [True] * 2
    for outbox in [ex.outbox for ex in pods.exchanges]:
        wait_for(lambda o=outbox: o.packed_bytes[0] > 0)


def test_auto_does_not_pack_while_a_pod_only_waits_on_a_late_peer(pods_factory, monkeypatch):  # noqa: F811
    # A fast link, and pod 1 starting every exchange 0.5 s after pod 0: pod 0 waits far longer
    # than packing would cost, but on a pod still computing, which packing cannot shorten. (Waits
    # under 0.3 s count for nothing here, so that a loaded machine's scheduling delays on the
    # wire cannot turn packing on; the 0.5 s wait on pod 1 still would, if it counted.)
    monkeypatch.setattr(LosslessPolicy, "MIN_WAIT_S", 0.3)
    pods = pods_factory(2, leaves=LEAVES, chunk=CHUNK, lossless="auto")
    for step in range(5):
        grads = gradients(2, seed=step)
        stats0, stats1 = _exchange_both(pods, step, grads, grads[1], pod1_after_s=0.5)
        assert stats0.idle_s > 0.25 and stats0.peer_wait_s > 0.25, stats0     # it did wait, on pod 1
        assert not stats0.packed and not stats1.packed
    assert not any(ex.lossless.packing for ex in pods.exchanges)


def _exchange_both(pods, step: int, grads, pod1_leaves, pod1_after_s: float = 0.0):
    """One exchange of 2 pods: pod 0 starts at once with grads[0], pod 1 `pod1_after_s` later
    with `pod1_leaves` (grads[1], or stand-ins for them); both sums are checked bitwise against
    the pod-order sum. Returns both pods' ExchangeStats."""
    import time
    for ex in pods.exchanges:
        ex.inbox.set_next_step(step)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(pods.exchanges[0].all_reduce, step, grads[0])
        time.sleep(pod1_after_s)
        summed1, stats1 = pods.exchanges[1].all_reduce(step, pod1_leaves)
        summed0, stats0 = first.result(timeout=60)
    for summed in (summed0, summed1):
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)
    return stats0, stats1


class _Late:
    """A leaf whose values are ready `delay_s` after the exchange asks for them, as the overlapped
    step's later leaves are while the backward pass still computes them."""

    def __init__(self, values: np.ndarray, delay_s: float):
        self.values, self.delay_s = values, delay_s

    def __array__(self, dtype=None, copy=None):
        import time
        time.sleep(self.delay_s)
        return self.values


def test_auto_does_not_pack_while_a_peer_computes_a_leaf_after_its_first_ones_went(pods_factory, monkeypatch):  # noqa: F811
    # The overlapped step's case: pod 1 sends its first leaf at once, then computes the next for
    # 0.6 s. Pod 0 waits that long on a peer whose first chunk has landed, so the split at the
    # first chunk (peer_wait_s) calls the wait the link's; no chunk lands during it, and the
    # wire wait counts only the burst that ends it. (Waits under 0.2 s count for nothing here,
    # so that a loaded machine's scheduling cannot turn packing on either way.)
    monkeypatch.setattr(LosslessPolicy, "MIN_WAIT_S", 0.2)
    pods = pods_factory(2, leaves=LEAVES, chunk=CHUNK, lossless="auto")
    for step in range(5):
        grads = gradients(2, seed=step)
        late = [grads[1][0], _Late(grads[1][1], 0.6), grads[1][2]]
        stats0, stats1 = _exchange_both(pods, step, grads, late)
        assert stats0.idle_s - stats0.peer_wait_s > 0.4, stats0      # what used to count as the link's
        assert stats0.wire_wait_s < 0.2, stats0
        assert not stats0.packed and not stats1.packed
    assert not any(ex.lossless.packing for ex in pods.exchanges)
