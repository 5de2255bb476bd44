"""The blocked wire encodings (int8, int4) against a plain numpy model of them: decoded values
bitwise the model's, at most half a step off, nbytes the payload's length, non-finite blocks NaN,
zero blocks zero, add= fused, deterministic; and int4 over the real exchange, healthy and degraded."""
from __future__ import annotations

import numpy as np
import pytest

from multipod.pod_worker.dcn import BLOCK, Plan, WireCodec
from tests.unit.pod_worker.test_dcn import LEAVES, assert_bitwise, compressed_reference, gradients, pods_factory  # noqa: F401
from tests.unit.pod_worker.test_dcn_degraded import ASSIGNMENTS, cluster_factory, slot_gradients  # noqa: F401

LEVELS = {"int8": 127, "int4": 7}
SIZES = [1, 2, 255, 256, 257, 511, 1000, 1001, 4099]
F32 = np.dtype(np.float32)


def reference(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales, integers, decoded) the straightforward way: block by block, rint, clip."""
    scales, ints, out = [], [], np.empty(values.size, np.float32)
    for a in range(0, values.size, BLOCK):
        block = values[a:a + BLOCK]
        with np.errstate(invalid="ignore", over="ignore"):
            scale = np.float32(np.max(np.abs(block))) / np.float32(levels)
            if not np.isfinite(scale):
                q, out[a:a + BLOCK] = np.zeros(block.size), np.nan
            elif scale == 0:
                q, out[a:a + BLOCK] = np.zeros(block.size), 0
            else:
                q = np.clip(np.rint(block / scale), -levels, levels)
                out[a:a + BLOCK] = q.astype(np.int8).astype(np.float32) * scale
        scales.append(scale)
        ints.append(q.astype(np.int8))
    return np.array(scales, np.float32), np.concatenate(ints), out


def pack_int4(ints: np.ndarray) -> bytes:
    """Two per byte, the even index in the low nibble; an odd count padded with a zero nibble."""
    nib = [int(q) & 0xF for q in ints] + [0] * (ints.size % 2)
    return bytes(lo | hi << 4 for lo, hi in zip(nib[0::2], nib[1::2]))


def sample(n: int, seed: int) -> np.ndarray:
    """Random values whose magnitude changes from block to block (and within blocks)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n // 37 + 1).repeat(37)[:n]).astype(np.float32)


def round_trip(codec: WireCodec, values: np.ndarray, add=None) -> np.ndarray:
    out = np.empty_like(values)
    codec.decode_into(codec.encode(values).tobytes(), out, add)
    return out


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("n", SIZES)
def test_blocked_codec_matches_the_reference_bitwise(name, n):
    codec, values = WireCodec(name), sample(n, seed=n)
    payload = codec.encode(values)
    assert payload.nbytes == codec.nbytes(n, F32) == -(-n // BLOCK) * 4 + (n if name == "int8" else -(-n // 2))
    scales, ints, want = reference(values, LEVELS[name])
    head = 4 * scales.size
    assert payload[:head].tobytes() == scales.tobytes()
    assert payload[head:].tobytes() == (ints.tobytes() if name == "int8" else pack_int4(ints))
    got = round_trip(codec, values)
    assert_bitwise(got, want)
    step = np.repeat(scales, BLOCK)[:n]
    assert np.all(np.abs(got - values) <= step * (0.5 + 1e-4))     # float32 rounding aside


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4"])
def test_nbytes_is_the_payload_length(name):
    codec = WireCodec(name)
    for n in SIZES:
        assert codec.encode(sample(n, seed=1)).nbytes == codec.nbytes(n, F32), n


def test_int4_uses_minus_7_to_7_in_nibbles():
    codec = WireCodec("int4")
    values = np.array([-7, -6.6, -0.4, 0, 0.6, 3, 7], np.float32)
    payload = codec.encode(values)
    assert payload[:4].view("<f4")[0] == 1 and payload[4:].tobytes() == bytes([0x99, 0x00, 0x31, 0x07])
    assert_bitwise(round_trip(codec, values), np.array([-7, -7, 0, 0, 1, 3, 7], np.float32))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_block_is_nan_and_zero_block_is_zero(name, bad):
    codec = WireCodec(name)
    values = sample(4 * BLOCK + 3, seed=2)
    values[BLOCK + 17] = bad                      # block 1: NaN, whole
    values[2 * BLOCK:3 * BLOCK] = 0               # block 2: zeros
    values[4 * BLOCK:] = 0                        # the short last block: zeros
    got = round_trip(codec, values)
    assert np.isnan(got[BLOCK:2 * BLOCK]).all()
    assert (got[2 * BLOCK:3 * BLOCK] == 0).all() and (got[4 * BLOCK:] == 0).all()
    rest = np.r_[0:BLOCK, 3 * BLOCK:4 * BLOCK]
    assert_bitwise(got[rest], round_trip(codec, values[rest]))     # blocks 0 and 3 as on their own
    assert np.isfinite(got[rest]).all()


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4"])
def test_add_sums_the_decoded_values(name):
    codec, values = WireCodec(name), sample(1001, seed=3)
    add = np.random.default_rng(4).standard_normal(values.size).astype(np.float32)
    assert_bitwise(round_trip(codec, values, add), round_trip(codec, values) + add)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_encoding_and_decoding_are_deterministic(name):
    codec, values = WireCodec(name), sample(1001, seed=5)
    first, second = codec.encode(values), codec.encode(values.copy())
    assert first.tobytes() == second.tobytes()
    a, b = np.empty_like(values), np.empty_like(values)
    codec.decode_into(first, a)                 # the sender's array
    codec.decode_into(second.tobytes(), b)      # a receiver's bytes
    assert_bitwise(a, b)


def test_int4_chunks_carry_twice_the_values_of_int8():
    plan4, plan8 = Plan(3, LEAVES, 64, "int4"), Plan(3, LEAVES, 64, "int8")
    assert plan4.chunk_elems == [128] * len(LEAVES) and plan8.chunk_elems == [64] * len(LEAVES)
    assert plan4.payload_bytes(0, 128) == 64 + 4 and plan4.payload_bytes(0, 35) == 18 + 4
    with pytest.raises(ValueError, match="half a byte"):
        WireCodec("int4").value_dtype(F32)


@pytest.mark.parametrize("num_pods", [2, 3, 4])
def test_int4_exchange_sums_equal_the_decoded_reference_on_every_pod(pods_factory, num_pods):  # noqa: F811
    pods = pods_factory(num_pods, compression="int4")
    grads = gradients(num_pods, seed=7)
    results = pods.all_reduce(0, grads)
    want = compressed_reference(grads, "int4")
    for summed, _ in results:
        for got, ref in zip(summed, want):
            assert_bitwise(np.asarray(got), ref)
    # Every slice's chunks cross each of the 2 (N - 1) links of the exchange once (a pod's own
    # slice not at all in reduce-scatter, to its N - 1 peers in all-gather): 2 pods, the whole leaf.
    plan = Plan(num_pods, LEAVES, 64, "int4")
    slices = [plan.ranges[i] if num_pods > 2 else [(0, spec.size)] for i, spec in enumerate(LEAVES)]
    per_slice = sum(plan.payload_bytes(i, b - a) for i, rs in enumerate(slices)
                    for start, stop in rs for a, b in plan.chunks(i, start, stop))
    links = 2 if num_pods == 2 else 2 * (num_pods - 1)
    assert sum(s.bytes_sent for _, s in results) == links * per_slice
    assert sum(s.bytes_sent for _, s in results) < sum(l.nbytes for l in LEAVES) * links / 6


def test_int4_degraded_sum_is_bitwise_the_healthy_sum(cluster_factory):  # noqa: F811
    cluster = cluster_factory(3)
    grads = slot_gradients(3, seed=3)
    healthy = cluster.run("healthy", grads, compression="int4")
    for k, hosts in enumerate(ASSIGNMENTS[3]):
        for summed, _ in cluster.run(f"degraded-{k}", grads, hosts=hosts, compression="int4").values():
            for got, want in zip(summed, healthy[0][0]):
                assert_bitwise(np.asarray(got), np.asarray(want))


def test_int8_clips_a_subnormal_block_to_127_instead_of_wrapping_around():
    # peak / 127 rounds to a subnormal scale far below it (190 ulps / 127 -> 1 ulp): 190 would wrap
    # to -66 in int8 (the sign flipped); clipped, it stays 127.
    tiny = np.float32(1e-45)
    values = np.array([190, -190, 5, 0], np.float32) * tiny
    decoded = round_trip(WireCodec("int8"), values)
    assert np.all(np.sign(decoded) == np.sign(values))
    assert WireCodec("int8").encode(values)[4:].view(np.int8).tolist() == [127, -127, 5, 0]


def test_int4_clips_a_subnormal_block_to_7():
    # peak / 7 rounds to a subnormal scale far below it (10 ulps / 7 -> 1 ulp): still in [-7, 7].
    tiny = np.float32(1e-45)
    values = np.array([10, -10, 3, 0], np.float32) * tiny
    scales, ints, want = reference(values, 7)
    assert list(ints) == [7, -7, 3, 0]
    assert WireCodec("int4").encode(values)[4:].tobytes() == pack_int4(ints)
    assert_bitwise(round_trip(WireCodec("int4"), values), want)
