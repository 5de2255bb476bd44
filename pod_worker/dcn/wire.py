"""The wire codec: how one chunk of a leaf's values travels, as raw bytes.

  * none: the values' own bytes (the sender hands zmq a view of the leaf: no copy).
  * bf16: each value rounded to bfloat16 (2 bytes).
  * int8: blocks of at most BLOCK values, each block with its own float32 scale; the payload is
    the chunk's scales followed by its int8 values. value = int8 * scale of its block.

encode() runs once, on the sender; decode_into() runs on every pod that uses the chunk, the sender
included, on the same bytes, so every pod sees the same decoded values (and the pods stay bitwise
identical whatever the rounding).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from multipod.model.config import to_enum
from multipod.pod_worker.schema import Compression

BLOCK = 256                       # int8: values per scale
_SCALE = np.dtype("<f4")


class WireCodec:
    def __init__(self, compression: Compression | str):
        self.compression = to_enum("dcn.compression", Compression, compression)   # ConfigError if unknown

    def value_dtype(self, leaf_dtype: np.dtype) -> np.dtype:
        """The dtype of one value on the wire."""
        if self.compression == "bf16":
            return np.dtype(ml_dtypes.bfloat16)
        if self.compression == "int8":
            return np.dtype(np.int8)
        return np.dtype(leaf_dtype)

    def nbytes(self, count: int, leaf_dtype: np.dtype) -> int:
        """Payload bytes of a chunk of `count` values."""
        values = count * self.value_dtype(leaf_dtype).itemsize
        if self.compression == "int8":
            values += math.ceil(count / BLOCK) * _SCALE.itemsize
        return values

    def encode(self, values: np.ndarray) -> np.ndarray:
        """1-d values -> a contiguous array whose bytes are the payload (`values` itself if none)."""
        if self.compression == "none":
            return np.ascontiguousarray(values)
        if self.compression == "bf16":
            return values.astype(ml_dtypes.bfloat16)
        count = values.size
        blocks = math.ceil(count / BLOCK)
        payload = np.empty(blocks * _SCALE.itemsize + count, np.uint8)
        scales = payload[:blocks * _SCALE.itemsize].view(_SCALE)
        quantised = payload[blocks * _SCALE.itemsize:].view(np.int8)
        flat = np.zeros(blocks * BLOCK, np.float32)
        flat[:count] = values
        padded = flat.reshape(blocks, BLOCK)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            # A block holding a non-finite value gets a non-finite scale: it decodes to NaN on
            # every pod alike, and every pod skips the update.
            peak = np.maximum(padded.max(axis=1), -padded.min(axis=1))
            scales[...] = peak / np.float32(127)
            usable = (scales != 0) & np.isfinite(scales)
            divisor = np.where(usable, scales, np.float32(1))[:, None]
            # |values / scale| <= 127 up to rounding, which rint absorbs: no clip needed.
            scaled = np.rint(padded / divisor)
            scaled[~usable] = 0
        quantised[...] = scaled.reshape(-1)[:count].astype(np.int8)
        return payload

    def decode_into(self, payload, out: np.ndarray, add: np.ndarray | None = None) -> None:
        """Payload bytes -> `out` (1-d, the leaf's dtype); with `add`, out = decoded + add."""
        if self.compression == "int8":
            self._decode_int8(payload, out)
            if add is not None:
                out += add
            return
        values = np.frombuffer(payload, self.value_dtype(out.dtype), count=out.size)
        if add is not None:
            np.add(add, values, out=out, casting="unsafe")   # decode and sum in one pass
        else:
            out[...] = values

    def _decode_int8(self, payload, out: np.ndarray) -> None:
        count = out.size
        blocks = math.ceil(count / BLOCK)
        scales = np.frombuffer(payload, _SCALE, count=blocks)
        quantised = np.frombuffer(payload, np.int8, count=count, offset=blocks * _SCALE.itemsize)
        full = count // BLOCK
        with np.errstate(invalid="ignore", over="ignore"):
            if full:
                np.multiply(quantised[:full * BLOCK].reshape(full, BLOCK), scales[:full, None],
                            out=out[:full * BLOCK].reshape(full, BLOCK), casting="unsafe")
            if count > full * BLOCK:
                np.multiply(quantised[full * BLOCK:], scales[full], out=out[full * BLOCK:], casting="unsafe")
            bad = ~np.isfinite(scales)
            if bad.any():   # NaN for the whole block, whatever its int8 values (0 * inf would vary)
                for b in np.flatnonzero(bad):
                    out[b * BLOCK:(b + 1) * BLOCK] = np.float32("nan")
