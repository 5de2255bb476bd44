"""The collective algorithms, as classes with one interface:

    run(step, leaves, order, on_leaf, deadline, stats, extra) -> the summed leaves, by leaf index

  * WholeGradient (2 pods): each pod sends its whole gradient to the other. A peer's chunk is
    added to this pod's own values as it lands (own + peer == peer + own bitwise: IEEE addition
    commutes), so a leaf is summed the moment its last chunk arrives.
  * ReduceScatterAllGather (N > 2 pods): pod p owns slice p of every leaf. Every pod sends slice p
    of its gradient to pod p (reduce-scatter); pod p sums the slices in pod-index order and sends
    its reduced slice to every pod (all-gather). Every pod, the owner included, uses the decoded
    bytes of the owner's slice, so all pods end with bitwise-identical sums.
  * SlotGather (degraded mode: some pods are down and live pods compute their slots too): every
    live pod sends the whole gradient of every slot it hosts to every other live pod, each slot
    encoded on the grid the healthy algorithm would have encoded it on; then every pod rebuilds,
    locally, exactly what the healthy algorithm computes from those N slot gradients (the same
    additions in the same order, the same re-encoding of each reduced chunk), so the sum is
    bitwise the healthy one. It costs more bytes than the healthy algorithm for N > 2 (whole
    gradients, not slices), and (N - 1) extra slice sums on each pod.

Both take the leaves in `order` (e.g. the last layer's first, as the backward pass produces them)
and read each one only when its turn comes, so host copies still under way (or leaves not yet
computed) overlap with sending the earlier ones. Compressed transport: every pod sums the
*decoded* values of every pod, its own included.
"""
from __future__ import annotations

import time

import numpy as np

from multipod.pod_worker import faults
from multipod.pod_worker.dcn.inbox import Inbox
from multipod.pod_worker.dcn.outbox import Outbox
from multipod.pod_worker.dcn.plan import PHASE_GATHER, PHASE_REDUCE, PHASE_WHOLE, Plan, slot_phase


def _values(leaf) -> np.ndarray:
    """A leaf's host values, flat (waits for this leaf's device->host copy only)."""
    return np.asarray(leaf).reshape(-1)


class _Collective:
    def __init__(self, plan: Plan, pod_index: int, inbox: Inbox, outbox: Outbox | None):
        self.plan, self.me, self.inbox, self.outbox = plan, pod_index, inbox, outbox
        self.peers = [p for p in plan.live if p != pod_index]

    def _wait(self, step: int, phase: int, leaf: int, deadline: float, stats) -> dict[int, np.ndarray]:
        start = time.monotonic()
        stats.began_waiting(start)
        try:
            return self.inbox.wait_leaf(step, phase, leaf, deadline)
        finally:
            self._waited(step, start, stats)

    def _waited(self, step: int, start: float, stats) -> None:
        """Account a wait on peers' chunks that began at `start` and ends now: all of it in
        idle_s, and in wire_wait_s the part from the first chunk that landed during it."""
        end = time.monotonic()
        stats.idle_s += end - start
        landed = self.inbox.first_landed_since(step, start)
        if landed is not None and landed < end:
            stats.wire_wait_s += end - landed

    def _put(self, step: int, deadline: float, peer: int, phase: int, leaf: int, offset: int, payload) -> int:
        """Queue one chunk for `peer`; the bytes it takes on the wire."""
        if self.outbox is None:     # a pod has an outbox whenever it has peers
            raise RuntimeError(f"pod {self.me} has no outbox to send pod {peer} a chunk")
        return self.outbox.put(step, deadline, peer, phase, leaf, offset, payload)

    def _send(self, step, deadline, stats, peers, phase, leaf, values, start, stop, decoded=None):
        """Encode values[0:stop-start] (the leaf's values [start, stop)) chunk by chunk, queue each
        chunk for `peers` and, if given, decode it into `decoded` (what this pod uses itself)."""
        codec = self.plan.codec
        for a, b in self.plan.chunks(leaf, start, stop):
            payload = codec.encode(values[a - start:b - start])
            for p in peers:
                stats.bytes_sent += self._put(step, deadline, p, phase, leaf, a, payload)
            if decoded is not None:
                codec.decode_into(payload, decoded[a - start:b - start])


class WholeGradient(_Collective):
    def run(self, step: int, leaves, order: list[int], on_leaf, deadline: float, stats, extra=None) -> list:
        plan, state = self.plan, self.inbox.state(step)
        own: dict[int, np.ndarray] = {}     # by leaf
        for i in order:
            values = _values(leaves[i])
            if plan.codec.compression == "none":
                own[i] = values
                self.inbox.set_own(step, i, values)
                self._send(step, deadline, stats, self.peers, PHASE_WHOLE, i, values, 0, values.size)
            else:
                own[i] = decoded = np.empty(values.size, values.dtype)
                self._send(step, deadline, stats, self.peers, PHASE_WHOLE, i, values, 0, values.size, decoded)
                self.inbox.set_own(step, i, decoded)
        (peer,) = self.peers
        results: list = [None] * len(plan.leaves)
        for i in order:
            self._wait(step, PHASE_WHOLE, i, deadline, stats)
            total = state.output[i]
            for a, b in state.slots[(PHASE_WHOLE, peer)].unfused[i]:   # chunks that came before own values
                total[a:b] += own[i][a:b]
            results[i] = on_leaf(i, total.reshape(plan.leaves[i].shape))
        return results


class ReduceScatterAllGather(_Collective):
    def run(self, step: int, leaves, order: list[int], on_leaf, deadline: float, stats, extra=None) -> list:
        plan, me, state = self.plan, self.me, self.inbox.state(step)
        compressed = plan.codec.compression != "none"
        own: dict[int, np.ndarray] = {}     # by leaf: this pod's slice
        for i in order:         # reduce-scatter: slice p of every leaf to pod p
            values = _values(leaves[i])
            for p, (a, b) in enumerate(plan.ranges[i]):
                if p != me:
                    self._send(step, deadline, stats, [p], PHASE_REDUCE, i, values[a:b], a, b)
                elif compressed:
                    own[i] = decoded = np.empty(b - a, values.dtype)
                    for ca, cb in plan.chunks(i, a, b):
                        plan.codec.decode_into(plan.codec.encode(values[ca:cb]), decoded[ca - a:cb - a])
                else:
                    own[i] = values[a:b]
        gather_to = self.peers
        if faults.gather_to_one_at(me, step):   # test hook (pod_worker/faults.py)
            gather_to = self.peers[:1]
        for i in order:         # sum the owned slice in pod order; all-gather it
            got = self._wait(step, PHASE_REDUCE, i, deadline, stats)
            got[me] = own[i]
            reduced = np.add(got[0], got[1])
            for p in range(2, plan.num_pods):
                reduced += got[p]
            a, b = plan.ranges[i][me]
            self._send(step, deadline, stats, gather_to, PHASE_GATHER, i, reduced, a, b, state.output[i][a:b])
        if gather_to != self.peers:
            faults.die_once_sent(self.outbox, gather_to[0])
        results: list = [None] * len(plan.leaves)
        for i in order:
            self._wait(step, PHASE_GATHER, i, deadline, stats)
            results[i] = on_leaf(i, state.output[i].reshape(plan.leaves[i].shape))
        return results


class SlotGather(_Collective):
    def run(self, step: int, leaves, order: list[int], on_leaf, deadline: float, stats, extra=None) -> list:
        plan, state = self.plan, self.inbox.state(step)
        codec = plan.codec
        compressed = codec.compression != "none"
        mine = {self.me: leaves, **(extra or {})}
        # decoded[slot][leaf]: the values every pod uses for that slot (its own bytes if uncompressed).
        decoded: dict[int, list] = {s: [None] * len(plan.leaves) for s in mine}
        for i in order:         # every hosted slot's whole leaf to every live peer, on the slot grid
            for s in sorted(mine):
                values = _values(mine[s][i])
                out = np.empty(values.size, values.dtype) if compressed else None
                for a, b in plan.slot_grid(i):
                    payload = codec.encode(values[a:b])
                    for p in self.peers:
                        stats.bytes_sent += self._put(step, deadline, p, slot_phase(s), i, a, payload)
                    if out is not None:
                        codec.decode_into(payload, out[a:b])
                decoded[s][i] = values if out is None else out
        results: list = [None] * len(plan.leaves)
        for i in order:
            start = time.monotonic()
            stats.began_waiting(start)
            try:
                got = self.inbox.wait_slots(step, i, deadline)
            finally:
                self._waited(step, start, stats)
            parts = [decoded[s][i] if s in decoded else got[s] for s in range(plan.num_pods)]
            total = state.output[i]
            if plan.whole:      # WholeGradient: own + peer, which is slot 0 + slot 1 (addition commutes)
                np.add(parts[0], parts[1], out=total)
            else:
                for a, b in plan.ranges[i]:     # what owner p reduces, then what its all-gather carries
                    reduced = np.add(parts[0][a:b], parts[1][a:b])
                    for q in range(2, plan.num_pods):
                        reduced += parts[q][a:b]
                    if not compressed:
                        total[a:b] = reduced
                        continue
                    for ca, cb in plan.chunks(i, a, b):
                        codec.decode_into(codec.encode(reduced[ca - a:cb - a]), total[ca:cb])
            results[i] = on_leaf(i, total.reshape(plan.leaves[i].shape))
        return results
