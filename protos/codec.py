"""The msgpack tensor codec: one array <-> bytes, used by the controller and the workers alike.

An encoded array is a msgpack map {"dtype": name, "shape": [...], "data": raw little-endian bytes}.
The data is packed from a memoryview (no intermediate copy) and decoded into a writable array.
bfloat16 comes from ml_dtypes, which jax already depends on.
"""
from __future__ import annotations

import math

import ml_dtypes
import msgpack
import numpy as np

# Every dtype that may cross the wire, by its canonical name. Anything else is refused.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
}
MAX_RANK = 8


class CodecError(ValueError):
    """A message that does not decode to a well-formed array."""


def dtype_name(dtype) -> str:
    """Canonical wire name of a numpy/jax dtype; CodecError if it may not cross the wire."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise CodecError(f"dtype {name!r} is not supported on the wire (supported: {sorted(DTYPES)})")
    return name


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype for a wire name; CodecError naming the value if unknown."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown dtype {name!r} (supported: {sorted(DTYPES)})") from None


def check_shape(shape, max_elements: int | None = None) -> tuple[int, ...]:
    """Validate a wire shape: a short list of non-negative ints, optionally bounded in size."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_RANK:
        raise CodecError(f"shape must be a list of at most {MAX_RANK} ints, got {shape!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CodecError(f"shape must hold non-negative ints, got {shape!r}")
    if max_elements is not None and math.prod(shape) > max_elements:
        raise CodecError(f"shape {tuple(shape)} has more than {max_elements} elements")
    return tuple(shape)


def encode(array) -> bytes:
    """Encode one array (numpy, or anything np.asarray accepts, e.g. a jax array)."""
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:   # (np.ascontiguousarray would turn 0-d into 1-d)
        arr = arr.copy(order="C")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    name = dtype_name(arr.dtype)
    # memoryview over the raw bytes: msgpack packs it without a tobytes() copy. A 0-d or empty
    # array is reshaped to 1-d first because memoryview.cast needs a non-zero-dim view.
    data = arr.reshape(-1).view(np.uint8).data if arr.size else b""
    return msgpack.packb({"dtype": name, "shape": list(arr.shape), "data": data}, use_bin_type=True)


def decode(payload: bytes, *, max_bytes: int | None = None) -> np.ndarray:
    """Decode bytes from encode() into a writable numpy array; CodecError if malformed."""
    if max_bytes is not None and len(payload) > max_bytes:
        raise CodecError(f"encoded array is {len(payload)} bytes, limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=len(payload),
                              max_str_len=64, max_array_len=64, max_map_len=8)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise CodecError(f"not a msgpack-encoded array: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise CodecError("encoded array must be a map with exactly dtype, shape and data")
    dtype = dtype_from_name(obj["dtype"])
    shape = check_shape(obj["shape"])
    data = obj["data"]
    if not isinstance(data, bytes):
        raise CodecError("data must be bytes")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise CodecError(f"data has {len(data)} bytes, shape {shape} of {dtype.name} needs {expected}")
    # bytearray makes the result writable (np.frombuffer over bytes is read-only).
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
