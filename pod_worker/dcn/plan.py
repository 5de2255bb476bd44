"""The plan: who sends which slice of which leaf to whom, cut into which chunks.

A pure function of (num_pods, leaves, chunk_bytes, compression, hosts), identical on every pod
(the config hash is checked before training starts, the hosts come from the controller), so a
receiver knows every chunk it must get.

  * 2 pods (PHASE_WHOLE): every pod sends its whole gradient to the other.
  * N > 2 pods: pod p owns slice p of every leaf (owned_ranges). PHASE_REDUCE: every pod sends
    slice p of its gradient to pod p. PHASE_GATHER: pod p sends its reduced slice to every pod.
  * Degraded (hosts is not the identity: hosts[slot] is the pod computing slot's shard): every
    live pod sends the whole gradient of every slot it hosts to every other live pod, in phase
    PHASE_SLOT_BASE + slot, cut on the grid the healthy algorithm encodes that slot's values on
    (slot_grid), so that every pod can rebuild the healthy sum bit for bit (collectives.SlotGather).
    A failed slot's microbatches may be split over several live pods, each continuing its
    predecessor's float32 partial sum (pod_worker/accumulate.py): a partial sum goes from one live
    pod to the next in phase PHASE_PARTIAL_BASE + slot, whole leaves and then one more "leaf",
    the loss sums (ce, z), raw float32 (never compressed: the sums must stay bitwise), on the
    grid of partial_chunks. Which pod passes to
    which is the step's (Exchange.send_partial / receive_partial); the plan checks the rest.

The phase byte of a data frame, over the whole data plane:
    0 PHASE_WHOLE, 1 PHASE_REDUCE, 2 PHASE_GATHER      the healthy gradient exchange
    8 PHASE_STATE_MANIFEST, 9 PHASE_STATE              a state transfer (transfer.py)
    10 PHASE_VOTE                                      the sender's state checksum before the step
    16 + slot (PHASE_SLOT_BASE), slot < MAX_PODS = 32  the degraded exchange
    48 + slot (PHASE_PARTIAL_BASE)                     a failed slot's partial sum (degraded)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from multipod.pod_worker.dcn.wire import WireCodec

PHASE_WHOLE = 0     # 2 pods: the sender's whole gradient
PHASE_REDUCE = 1    # N > 2: the receiver's slice of the sender's gradient
PHASE_GATHER = 2    # N > 2: the sender's reduced slice
PHASE_STATE_MANIFEST = 8    # state transfer: the donor's step and fingerprint
PHASE_STATE = 9             # state transfer: raw bytes of a parameter or optimizer-state leaf
PHASE_VOTE = 10             # every step: the sender's state checksum as the step starts (one uint64)
VOTE_DTYPE = np.dtype("<u8")
PHASE_SLOT_BASE = 16        # degraded: PHASE_SLOT_BASE + slot carries that slot's whole gradient
MAX_SLOTS = 32              # the phase byte leaves room for 240; the worker serves at most 32 pods
PHASE_PARTIAL_BASE = PHASE_SLOT_BASE + MAX_SLOTS    # degraded, split: + slot carries a partial sum
PARTIAL_DTYPE = np.dtype("<f4")     # a partial sum's values: float32 (accumulate.py), raw on the wire


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


def check_hosts(hosts, num_pods: int) -> tuple[int, ...] | None:
    """`hosts` as a tuple, or None if it is the identity (every pod computes its own shard).
    ValueError if it is not an assignment of the slots to live pods."""
    if hosts is None:
        return None
    hosts = tuple(int(h) for h in hosts)
    if len(hosts) != num_pods:
        raise ValueError(f"hosts must name a pod for each of the {num_pods} slots, got {list(hosts)}")
    if any(not 0 <= h < num_pods for h in hosts):
        raise ValueError(f"hosts {list(hosts)}: every host must be a pod in [0, {num_pods})")
    if any(hosts[h] != h for h in set(hosts)):
        raise ValueError(f"hosts {list(hosts)}: a pod that hosts a slot must compute its own slot too")
    if num_pods > MAX_SLOTS:
        raise ValueError(f"degraded mode supports at most {MAX_SLOTS} pods, got {num_pods}")
    return None if hosts == tuple(range(num_pods)) else hosts


def slot_phase(slot: int) -> int:
    """The phase of the chunks carrying `slot`'s gradient in degraded mode."""
    return PHASE_SLOT_BASE + slot


def partial_phase(slot: int) -> int:
    """The phase of the chunks carrying a partial sum of failed slot `slot`'s gradient."""
    return PHASE_PARTIAL_BASE + slot


class Plan:
    def __init__(self, num_pods: int, leaves: list[LeafSpec], chunk_bytes: int, compression: str,
                 hosts: list[int] | tuple[int, ...] | None = None):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.num_pods = num_pods
        self.leaves = leaves
        self.codec = WireCodec(compression)
        # Values per chunk: chunk_bytes of wire values (int8 and int4 add their scales on top).
        self.chunk_elems = [self.codec.chunk_values(chunk_bytes, l.dtype) for l in leaves]
        self.whole = num_pods <= 2
        self.ranges = [owned_ranges(l.size, num_pods) for l in leaves]
        self.total_bytes = sum(l.nbytes for l in leaves)
        assigned = check_hosts(hosts, num_pods)        # None: healthy
        self.degraded = assigned is not None
        # hosts[slot]: the live pod that computes slot's shard (each pod its own when healthy).
        self.hosts: tuple[int, ...] = assigned if assigned is not None else tuple(range(num_pods))
        self.live = sorted(set(self.hosts))
        # Degraded: the slot grid of every leaf, and each chunk's (index, stop) by its offset.
        self._grids: list[list[tuple[int, int]]] = []
        self._grid_at: list[dict[int, tuple[int, int]]] = []
        if self.degraded:
            for i in range(len(leaves)):
                grid = self._slot_grid(i)
                self._grids.append(grid)
                self._grid_at.append({a: (k, b) for k, (a, b) in enumerate(grid)})
        # A partial sum's chunks: chunk_bytes of float32 values.
        self.partial_elems = max(1, chunk_bytes // PARTIAL_DTYPE.itemsize)
        self.partial_sizes = [l.size for l in leaves] + [2]     # the gradient's leaves, then (ce, z)
        self.failed = [s for s, h in enumerate(self.hosts) if h != s]

    def phases(self) -> tuple[int, ...]:
        """The gradient's phases in this exchange (PHASE_VOTE, every step's, aside)."""
        if self.degraded:
            return (*(slot_phase(s) for s in range(self.num_pods)), *(partial_phase(s) for s in self.failed))
        return (PHASE_WHOLE,) if self.whole else (PHASE_REDUCE, PHASE_GATHER)

    def partial_chunks(self, leaf: int):
        """(start, stop) of each chunk of partial-sum leaf `leaf` (a whole gradient leaf, float32,
        or, as leaf len(leaves), the loss sums)."""
        size, step = self.partial_sizes[leaf], self.partial_elems
        for a in range(0, size, step):
            yield a, min(a + step, size)

    def partial_count(self, leaf: int) -> int:
        return math.ceil(self.partial_sizes[leaf] / self.partial_elems)

    def hosted(self, pod: int) -> list[int]:
        """The slots `pod` computes (degraded mode), its own first; [pod] when healthy."""
        if not self.degraded:
            return [pod]
        return [pod] + [s for s, h in enumerate(self.hosts) if h == pod and s != pod]

    def span(self, phase: int, sender: int, receiver: int, leaf: int) -> tuple[int, int]:
        """The element range of `leaf` that `sender` sends `receiver` in `phase`."""
        if phase == PHASE_WHOLE or phase >= PHASE_SLOT_BASE:
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

    def _slot_grid(self, leaf: int) -> list[tuple[int, int]]:
        # The chunks the healthy algorithm encodes one pod's values of `leaf` in (int8 blocks
        # restart at every chunk, so the grid decides the decoded values): 2 pods, the whole
        # leaf; N > 2, each owner's slice on its own grid (reduce-scatter).
        if self.whole:
            return list(self.chunks(leaf, 0, self.leaves[leaf].size))
        return [c for a, b in self.ranges[leaf] for c in self.chunks(leaf, a, b)]

    def slot_grid(self, leaf: int) -> list[tuple[int, int]]:
        """Degraded: the chunks a slot's values of `leaf` are encoded and sent in."""
        return self._grids[leaf]

    def slot_chunk(self, leaf: int, offset: int) -> tuple[int, int] | None:
        """Degraded: (index, stop) of the slot-grid chunk of `leaf` starting at `offset`, if any."""
        return self._grid_at[leaf].get(offset)

    def payload_bytes(self, leaf: int, count: int) -> int:
        """Wire bytes of a chunk of `count` values of `leaf`."""
        return self.codec.nbytes(count, self.leaves[leaf].dtype)
