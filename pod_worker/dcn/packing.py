"""Lossless packing of a chunk's payload (dcn.lossless), and when to pack (LosslessPolicy).

A packed payload is PACKED_HEAD (the payload's value size in bytes, its length in bytes) and one
zstd frame of the payload byte-shuffled: byte k of every value first, then byte k + 1, and so on.
Shuffling puts the values' sign and exponent bytes side by side, where zstd finds their
redundancy; mantissa bytes are close to random and stay about as long. A gradient's float32 values
pack to about 0.84 of their bytes, bf16 values to about 0.68 (docs/benchmarks.md). Unpacking gives
back the payload bit for bit, so the pods' pod-order sum, and their parameters, are unchanged.

Packing costs CPU, about 30 ms per 17 MB on one core here, and unpacking about 25: it pays where
the link sets the pace of the step. LosslessPolicy turns it on when an exchange (after a run's
first two) left the pod waiting on its peers' bytes on the wire (not on a peer still computing)
for over twice what packing them would cost, and off after several exchanges in a row waited less
than that cost.
"""
from __future__ import annotations

import struct

import numpy as np
import zstandard

from multipod.pod_worker.schema import Lossless

PACKED_HEAD = struct.Struct("<BI")       # value size in bytes (1, 2, 4 or 8), payload bytes
MIN_PACK_BYTES = 16 << 10           # smaller chunks (state votes, small leaves) go as they are
_LEVEL = 1                          # zstd's fastest level: higher ones packed no smaller here
_KEEP = 0.97                        # a packed payload must save at least 3%, else the raw one goes


class PackingError(ValueError):
    """A packed payload that does not unpack to what its head says."""


class Packer:
    """Packs payloads; one per sending thread (a zstd compressor is not thread-safe)."""

    def __init__(self) -> None:
        self._zstd = zstandard.ZstdCompressor(level=_LEVEL)

    def pack(self, data: np.ndarray, itemsize: int) -> bytes | None:
        """`data`: a payload's bytes (1-d uint8) of values `itemsize` bytes each. The packed
        payload, or None if packing would not save enough to be worth the receiver's unpacking."""
        if data.nbytes < MIN_PACK_BYTES or itemsize not in (1, 2, 4, 8) or data.nbytes % itemsize:
            return None
        shuffled = data.reshape(-1, itemsize).T if itemsize > 1 else data
        frame = self._zstd.compress(np.ascontiguousarray(shuffled).data)
        if PACKED_HEAD.size + len(frame) > _KEEP * data.nbytes:
            return None
        return PACKED_HEAD.pack(itemsize, data.nbytes) + frame


def unpack(packed, limit: int) -> np.ndarray:
    """A packed payload (any buffer) -> the payload's bytes (1-d uint8). PackingError if it is
    malformed, claims more than `limit` bytes, or does not unpack to exactly what its head says:
    the head is checked before any byte is unpacked, so a frame cannot make this pod allocate more
    than `limit`."""
    view = memoryview(packed).cast("B")
    if len(view) < PACKED_HEAD.size:
        raise PackingError(f"a packed payload of {len(view)} bytes is shorter than its head")
    itemsize, nbytes = PACKED_HEAD.unpack_from(view)
    if itemsize not in (1, 2, 4, 8) or nbytes % itemsize or not 0 < nbytes <= limit:
        raise PackingError(f"a packed payload's head claims {nbytes} bytes of {itemsize}-byte values "
                           f"(at most {limit} bytes, a whole number of values)")
    frame = view[PACKED_HEAD.size:]
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != nbytes:
            raise PackingError(f"a packed payload's zstd frame holds {declared} bytes, its head says {nbytes}")
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=nbytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise PackingError(f"a packed payload does not unpack: {exc}") from None
    if len(raw) != nbytes:
        raise PackingError(f"a packed payload unpacked to {len(raw)} bytes, its head says {nbytes}")
    shuffled = np.frombuffer(raw, np.uint8)
    if itemsize == 1:
        return shuffled
    return np.ascontiguousarray(shuffled.reshape(itemsize, -1).T).reshape(-1)


class LosslessPolicy:
    """Whether this pod packs the chunks it queues (dcn.lossless), decided after each exchange
    from what it cost. The choice is this pod's alone: a receiver unpacks whatever comes packed,
    and packing is lossless, so pods may differ in it without the sum differing."""

    PACK_BYTES_PER_S = 400e6    # one core packing float32 gradients: 17 MB in 30-40 ms here
    ON_FACTOR = 2.0             # waited on peers' bytes > 2x what packing them costs: pack
    MIN_WAIT_S = 0.02           # below this, no wait is worth acting on
    # Packing shortens the very wait that turned it on, so one short wait says little: it stops
    # only after this many exchanges in a row waited less than packing costs.
    OFF_AFTER = 8
    # The first exchanges of a run wait on peers still compiling or loading their programs, not on
    # the link: they decide nothing.
    SETTLE = 2

    def __init__(self, mode: Lossless | str):
        self.mode = Lossless(mode)
        self.packing = self.mode == Lossless.ON
        self._short_waits = 0
        self._seen = 0

    def update(self, bytes_sent: int, wire_wait_s: float) -> bool:
        """After an exchange that queued `bytes_sent` and waited `wire_wait_s` for the peers'
        bytes while they were landing (ExchangeStats.wire_wait_s: a wait on a pod still computing
        is none of the link's doing, and packing would not shorten it): whether the next one
        packs. True when the choice changed."""
        self._seen += 1
        if self.mode != Lossless.AUTO or self._seen <= self.SETTLE:
            return False
        cost = bytes_sent / self.PACK_BYTES_PER_S
        if not self.packing:
            if wire_wait_s > max(self.ON_FACTOR * cost, self.MIN_WAIT_S) and bytes_sent >= MIN_PACK_BYTES:
                self.packing, self._short_waits = True, 0
                return True
            return False
        self._short_waits = self._short_waits + 1 if wire_wait_s < max(cost, self.MIN_WAIT_S) else 0
        if self._short_waits >= self.OFF_AFTER:
            self.packing = False
            return True
        return False
