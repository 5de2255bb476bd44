"""The plan: who sends which slice of which leaf to whom, cut into which chunks.

A pure function of (num_pods, leaves, chunk_bytes, compression), identical on every pod (the
config hash is checked before training starts), so a receiver knows every chunk it must get.

  * 2 pods (PHASE_WHOLE): every pod sends its whole gradient to the other.
  * N > 2 pods: pod p owns slice p of every leaf (owned_ranges). PHASE_REDUCE: every pod sends
    slice p of its gradient to pod p. PHASE_GATHER: pod p sends its reduced slice to every pod.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from multipod.pod_worker.dcn.wire import WireCodec

PHASE_WHOLE = 0     # 2 pods: the sender's whole gradient
PHASE_REDUCE = 1    # N > 2: the receiver's slice of the sender's gradient
PHASE_GATHER = 2    # N > 2: the sender's reduced slice


@dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one gradient leaf (as the pod holds it; the wire dtype may differ)."""
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def owned_ranges(size: int, num_pods: int) -> list[tuple[int, int]]:
    """The element range [start, stop) of a leaf that each pod reduces (N > 2 pods)."""
    bounds = [size * k // num_pods for k in range(num_pods + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(num_pods)]


class Plan:
    def __init__(self, num_pods: int, leaves: list[LeafSpec], chunk_bytes: int, compression: str):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.num_pods = num_pods
        self.leaves = leaves
        self.codec = WireCodec(compression)
        # Values per chunk: chunk_bytes of wire values (int8 adds its scales on top).
        self.chunk_elems = [max(1, chunk_bytes // self.codec.value_dtype(l.dtype).itemsize) for l in leaves]
        self.whole = num_pods <= 2
        self.ranges = [owned_ranges(l.size, num_pods) for l in leaves]
        self.total_bytes = sum(l.nbytes for l in leaves)

    def phases(self) -> tuple[int, ...]:
        return (PHASE_WHOLE,) if self.whole else (PHASE_REDUCE, PHASE_GATHER)

    def span(self, phase: int, sender: int, receiver: int, leaf: int) -> tuple[int, int]:
        """The element range of `leaf` that `sender` sends `receiver` in `phase`."""
        if phase == PHASE_WHOLE:
            return 0, self.leaves[leaf].size
        if phase == PHASE_REDUCE:
            return self.ranges[leaf][receiver]
        return self.ranges[leaf][sender]

    def chunks(self, leaf: int, start: int, stop: int):
        """(start, stop) of each chunk of the fixed grid over [start, stop)."""
        step = self.chunk_elems[leaf]
        for a in range(start, stop, step):
            yield a, min(a + step, stop)

    def chunk_count(self, leaf: int, start: int, stop: int) -> int:
        return math.ceil((stop - start) / self.chunk_elems[leaf])

    def payload_bytes(self, leaf: int, count: int) -> int:
        """Wire bytes of a chunk of `count` values of `leaf`."""
        return self.codec.nbytes(count, self.leaves[leaf].dtype)
