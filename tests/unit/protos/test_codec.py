"""The tensor codec round-trips exactly and refuses malformed payloads with a clear error."""
import ml_dtypes
import msgpack
import numpy as np
import pytest

from multipod.protos import codec


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.array([np.nan, np.inf, -0.0, 1e-45], dtype=np.float32),
    np.array([[1.5, -2.25], [3.0e38, 1e-40]], dtype=ml_dtypes.bfloat16),
    np.arange(-5, 5, dtype=np.int32).reshape(2, 5),
    np.zeros((0,), dtype=np.float32),
    np.zeros((3, 0, 2), dtype=np.int32),
    np.array(7, dtype=np.int32),
    np.arange(256, dtype=np.uint8),
])
def test_round_trip_is_exact(array):
    decoded = codec.decode(codec.encode(array))
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    # Compare bytes, so NaN payloads and -0.0 count too.
    assert decoded.tobytes() == np.ascontiguousarray(array).tobytes()
    assert decoded.flags.writeable


def test_non_contiguous_and_big_endian_inputs():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert np.array_equal(codec.decode(codec.encode(base[:, ::2])), base[:, ::2])
    big = np.arange(5, dtype=">i4")
    out = codec.decode(codec.encode(big))
    assert out.dtype == np.int32 and np.array_equal(out, big)


def test_jax_arrays_encode():
    import jax.numpy as jnp
    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    assert np.array_equal(codec.decode(codec.encode(x)), np.asarray(x))


@pytest.mark.parametrize("payload, message", [
    (b"\xff\x00garbage", "not a msgpack"),
    (msgpack.packb([1, 2, 3]), "must be a map"),
    (msgpack.packb({"dtype": "complex128", "shape": [1], "data": b"\0" * 16}), "unknown dtype"),
    (msgpack.packb({"dtype": "float32", "shape": [2], "data": b"\0" * 4}), "needs 8"),
    (msgpack.packb({"dtype": "float32", "shape": [-1], "data": b""}), "non-negative"),
    (msgpack.packb({"dtype": "float32", "shape": [1] * 9, "data": b"\0" * 4}), "shape"),
    (msgpack.packb({"dtype": "float32", "shape": [1], "data": "text"}), "bytes"),
    (msgpack.packb({"dtype": "float32", "shape": [1], "data": b"\0" * 4, "x": 1}), "exactly"),
])
def test_malformed_payloads_are_refused(payload, message):
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(payload)


def test_size_limit():
    payload = codec.encode(np.zeros(1000, np.float32))
    with pytest.raises(codec.CodecError, match="limit"):
        codec.decode(payload, max_bytes=100)


def test_unsupported_dtype_on_encode():
    with pytest.raises(codec.CodecError, match="complex"):
        codec.encode(np.zeros(2, np.complex64))
