"""The wire codec: how one chunk of a leaf's values travels, as raw bytes.

  * none: the values' own bytes (the sender hands zmq a view of the leaf: no copy).
  * bf16: each value rounded to bfloat16 (2 bytes).
  * int8: blocks of at most BLOCK values, each block with its own float32 scale; the payload is
    the chunk's scales followed by its int8 values. value = int8 * scale of its block.
  * int4: int8's blocks and float32 scales (block peak / 7), each value rounded to an integer in
    [-7, 7] and stored two per byte (low nibble: even index, high nibble: odd index, two's
    complement; an odd count ends in a zero nibble); the payload is the chunk's scales followed by
    its ceil(count / 2) value bytes. value = int4 * scale of its block. The outer-gradient encoding
    of Streaming DiLoCo.
  A block holding a non-finite value (int8, int4) decodes to NaN as a whole, on every pod.

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

BLOCK = 256                       # int8, int4: values per scale
_SCALE = np.dtype("<f4")
_LEVELS = {"int8": 127, "int4": 7}     # the largest quantised magnitude of a blocked encoding


class WireCodec:
    def __init__(self, compression: Compression | str):
        self.compression = to_enum("dcn.compression", Compression, compression)   # ConfigError if unknown

    def value_dtype(self, leaf_dtype: np.dtype) -> np.dtype:
        """The dtype of one value on the wire. int4 has none (two values share a byte): sizes
        come from nbytes() and chunk_values()."""
        if self.compression == "bf16":
            return np.dtype(ml_dtypes.bfloat16)
        if self.compression == "int8":
            return np.dtype(np.int8)
        if self.compression == "int4":
            raise ValueError("int4 values take half a byte each: use nbytes() / chunk_values() for sizes")
        return np.dtype(leaf_dtype)

    def chunk_values(self, chunk_bytes: int, leaf_dtype: np.dtype) -> int:
        """Values per chunk whose wire values take chunk_bytes (the blocks' scales come on top)."""
        if self.compression == "int4":
            return max(1, 2 * chunk_bytes)
        return max(1, chunk_bytes // self.value_dtype(leaf_dtype).itemsize)

    def nbytes(self, count: int, leaf_dtype: np.dtype) -> int:
        """Payload bytes of a chunk of `count` values (exactly the length of encode()'s bytes)."""
        if self.compression == "int4":
            return (count + 1) // 2 + math.ceil(count / BLOCK) * _SCALE.itemsize
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
        head = blocks * _SCALE.itemsize
        value_bytes = count if self.compression == "int8" else (count + 1) // 2
        payload = np.empty(head + value_bytes, np.uint8)
        scaled = _quantise(values, payload[:head].view(_SCALE), _LEVELS[self.compression])
        if self.compression == "int8":
            payload[head:].view(np.int8)[...] = scaled.reshape(-1)[:count].astype(np.int8)
        else:   # int4: two's complement nibbles, the even index low (an odd count's last high
            # nibble is the block's zero padding)
            nibbles = scaled.reshape(-1)[:2 * value_bytes].astype(np.int8).view(np.uint8) & np.uint8(0xF)
            np.bitwise_or(nibbles[0::2], nibbles[1::2] << np.uint8(4), out=payload[head:])
        return payload

    def decode_into(self, payload, out: np.ndarray, add: np.ndarray | None = None) -> None:
        """Payload bytes -> `out` (1-d, the leaf's dtype); with `add`, out = decoded + add."""
        if self.compression in _LEVELS:
            self._decode_blocks(payload, out)
            if add is not None:
                out += add
            return
        values = np.frombuffer(payload, self.value_dtype(out.dtype), count=out.size)
        if add is not None:
            np.add(add, values, out=out, casting="unsafe")   # decode and sum in one pass
        else:
            out[...] = values

    def _decode_blocks(self, payload, out: np.ndarray) -> None:
        count = out.size
        blocks = math.ceil(count / BLOCK)
        scales = np.frombuffer(payload, _SCALE, count=blocks)
        if self.compression == "int8":
            quantised = np.frombuffer(payload, np.int8, count=count, offset=blocks * _SCALE.itemsize)
        else:   # int4: each byte -> its (low, high) values, sign-extended by an arithmetic shift
            packed = np.frombuffer(payload, np.uint8, count=(count + 1) // 2, offset=blocks * _SCALE.itemsize)
            pairs = np.empty((packed.size, 2), np.int8)
            np.right_shift((packed << np.uint8(4)).view(np.int8), 4, out=pairs[:, 0])
            np.right_shift(packed.view(np.int8), 4, out=pairs[:, 1])
            quantised = pairs.reshape(-1)[:count]      # an odd count's padding nibble dropped
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


def _quantise(values: np.ndarray, scales: np.ndarray, levels: int) -> np.ndarray:
    """Fill `scales` (one per block of BLOCK values: block peak / levels) and return the values as
    integers in [-levels, levels] (float32, blocks x BLOCK, zero beyond `values`)."""
    count, blocks = values.size, scales.size
    flat = np.zeros(blocks * BLOCK, np.float32)
    flat[:count] = values
    padded = flat.reshape(blocks, BLOCK)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # A block holding a non-finite value gets a non-finite scale: it decodes to NaN on
        # every pod alike, and every pod skips the update.
        peak = np.maximum(padded.max(axis=1), -padded.min(axis=1))
        scales[...] = peak / np.float32(levels)
        usable = (scales != 0) & np.isfinite(scales)
        divisor = np.where(usable, scales, np.float32(1))[:, None]
        # |values / scale| <= levels up to rounding, which rint absorbs; the clip guards against
        # a subnormal scale, rounded far below peak / levels (an int8 value would wrap around).
        scaled = np.rint(padded / divisor)
        np.clip(scaled, -levels, levels, out=scaled)
        scaled[~usable] = 0
    return scaled
