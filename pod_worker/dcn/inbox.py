"""The inbox: validates every chunk peers send this pod and writes it straight into buffers
preallocated for the step; hands complete leaves to the step thread.

A chunk is accepted only if its step is the one this pod works on or the next, its phase is used
with this many pods, its leaf exists, its offset lies on the plan's chunk grid of the slice that
pod sends this pod, its size is the size the plan says, and it was not received before. A refused
chunk writes nothing: the step is never corrupted. Its reason is kept, so a step that then misses
that peer's bytes fails at the deadline saying why.

Degraded mode (plan.hosts): a slot's chunks are accepted only from the live pod that hosts the
slot, on the slot grid (plan.slot_grid); wait_slots hands the step every other live pod's slots.
Pods that are not live have no place in a step: nothing of theirs is accepted or waited for.
A failed slot's partial sum (split microbatches, plan.partial_phase) is accepted from any other
live pod, whole float32 leaves on the plan's partial grid, raw; its buffer is made when its first
chunk (or the step's wait for it) comes, so at most one per failed slot and live peer per step
(two steps at a time); the step waits only for the one its predecessor sends (wait_partial).

abort() makes every wait fail at once and refuses every later chunk (the exchange is done for).
"""
from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

import numpy as np

from multipod.pod_worker.dcn.plan import (
    PARTIAL_DTYPE,
    PHASE_GATHER,
    PHASE_PARTIAL_BASE,
    PHASE_SLOT_BASE,
    PHASE_VOTE,
    PHASE_WHOLE,
    VOTE_DTYPE,
    LeafSpec,
    Plan,
    partial_phase,
    slot_phase,
)


class InvalidChunk(ValueError):
    """A chunk that does not belong to any gradient this pod expects."""


class ExchangeError(RuntimeError):
    """The exchange of a step failed: a peer's gradient did not arrive complete within the
    deadline, a peer's connection broke, or sending to a peer failed."""


class StateVoteError(ExchangeError):
    """The live pods started a step from different states (their state checksums differ): the
    step is not applied anywhere. `states`: {pod: its state checksum} of every live pod."""

    def __init__(self, step: int, states: dict[int, int]):
        self.step, self.states = step, dict(states)
        detail = ", ".join(f"pod {p}: {s:016x}" for p, s in sorted(self.states.items()))
        super().__init__(f"step {step}: the pods start from different states ({detail}): the step is not applied")


class _Slot:
    """What one peer sends this pod in one phase of one step: one target per leaf."""

    def __init__(self, spans: list[tuple[int, int]], targets: list[np.ndarray], counts: list[int]):
        self.spans = spans
        self.targets = targets
        self.seen: list[set[int]] = [set() for _ in spans]
        self.missing = list(counts)         # chunks still to come, by leaf
        self.bytes = 0
        self.unfused: list[list[tuple[int, int]]] = [[] for _ in spans]   # 2 pods: ranges still to add


class _StepState:
    """Everything this pod receives for one step, allocated when the step's first chunk (or the
    step itself) arrives."""

    def __init__(self, plan: Plan, pod: int):
        self.errors: dict[int, str] = {}       # pod -> why its part of the step failed
        # pod -> when its first gradient chunk of the step had landed (time.monotonic()): a wait
        # before then is a wait on a pod still computing (ExchangeStats.peer_wait_s).
        self.first_chunk_at: dict[int, float] = {}
        # When each gradient chunk of the step landed (time.monotonic(), in order): a wait during
        # which chunks kept landing is a wait on the link; one during which none did is a wait on
        # a peer still computing the leaf (the overlapped step sends each leaf as it is ready).
        self.landed: list[float] = []
        self.slots: dict[tuple[int, int], _Slot] = {}
        # The result. 2 pods: the peer's chunks are added to this pod's own values as they arrive
        # (own + peer == peer + own bitwise: IEEE addition commutes), so the sum is done when the
        # last chunk lands. N > 2: the all-gather writes every owner's reduced slice into it.
        self.output = [np.empty(l.size, l.dtype) for l in plan.leaves]
        self.own: list[np.ndarray | None] = [None] * len(plan.leaves)   # 2 pods: this pod's values
        if plan.degraded:   # every slot another live pod hosts, whole, on the slot grid
            counts = [len(plan.slot_grid(i)) for i in range(len(plan.leaves))]
            for slot, host in enumerate(plan.hosts):
                if host != pod:
                    self.slots[(slot_phase(slot), host)] = _Slot(
                        [(0, l.size) for l in plan.leaves], [np.empty(l.size, l.dtype) for l in plan.leaves], counts)
            return
        for phase in plan.phases():
            for peer in (p for p in range(plan.num_pods) if p != pod):
                spans = [plan.span(phase, peer, pod, i) for i in range(len(plan.leaves))]
                if phase in (PHASE_GATHER, PHASE_WHOLE):
                    targets = [self.output[i][a:b] for i, (a, b) in enumerate(spans)]
                else:
                    targets = [np.empty(b - a, l.dtype) for (a, b), l in zip(spans, plan.leaves)]
                counts = [plan.chunk_count(i, a, b) for i, (a, b) in enumerate(spans)]
                self.slots[(phase, peer)] = _Slot(spans, targets, counts)


class Inbox:
    """Receives peers' chunks (from the Listener's thread) and hands complete leaves to the step
    thread (wait_leaf). Thread-safe."""

    def __init__(self, run_id: str, pod_index: int, plan: Plan):
        self.run_id = run_id
        self.pod_index = pod_index
        self.plan = plan
        self.num_pods = plan.num_pods
        self.leaves: list[LeafSpec] = plan.leaves
        self._cond = threading.Condition()
        self._steps: dict[int, _StepState] = {}
        self._refusals: dict[int, str] = {}     # pod -> why its last refused chunk was refused
        self._gone: dict[int, str] = {}         # pod -> why a connection of it closed (this run: for good)
        self._next_step = 0                     # the step this pod will complete next
        self._aborted = ""                      # why, once aborted

    def set_next_step(self, step: int) -> None:
        """The pod is now working towards `step`: drop anything older (it can no longer be used)."""
        with self._cond:
            self._next_step = step
            for old in [s for s in self._steps if s < step]:
                del self._steps[old]
            self._cond.notify_all()

    def _state(self, step: int) -> _StepState:
        # A peer can be at most one step ahead: it cannot finish step s without our gradient.
        if not self._next_step <= step <= self._next_step + 1:
            raise InvalidChunk(f"chunk for step {step}, pod {self.pod_index} expects step {self._next_step}"
                               f" or {self._next_step + 1}")
        state = self._steps.get(step)
        if state is None:
            state = self._steps[step] = _StepState(self.plan, self.pod_index)
        return state

    def state(self, step: int) -> _StepState:
        """The receive state of `step` (created if needed)."""
        with self._cond:
            return self._state(step)

    # -- from the listener ----------------------------------------------------------------------
    def _accept(self, pod: int, step: int, phase: int, leaf: int, offset: int, size: int):
        """Validate a chunk's header and reserve its place; returns where to decode it to."""
        if self._aborted:
            raise InvalidChunk(f"the exchange of pod {self.pod_index} was aborted ({self._aborted})")
        if not 0 <= pod < self.num_pods or pod == self.pod_index:
            raise InvalidChunk(f"pod {pod} is not a peer of pod {self.pod_index} (pods 0..{self.num_pods - 1})")
        if pod not in self.plan.live:
            raise InvalidChunk(f"pod {pod} is not taking part in the exchange (the live pods are {self.plan.live})")
        if phase == PHASE_VOTE:
            if leaf or offset or size != VOTE_DTYPE.itemsize:
                raise InvalidChunk(f"a state vote is one uint64 at leaf 0, offset 0, got leaf {leaf}, offset "
                                   f"{offset}, {size} bytes")
            slot = self._vote_slot(self._state(step), pod)
            if slot.seen[0]:
                raise InvalidChunk(f"a second state vote of pod {pod} for step {step}")
            slot.seen[0].add(0)
            return slot, slot.targets[0], None
        if phase not in self.plan.phases():
            raise InvalidChunk(f"phase {phase} is not used with {self.num_pods} pods (expected one of "
                               f"{self.plan.phases()})")
        if leaf >= len(self.leaves) + (phase >= PHASE_PARTIAL_BASE):    # a partial sum has the losses too
            raise InvalidChunk(f"leaf {leaf} out of range (the gradient has {len(self.leaves)} leaves)")
        if phase >= PHASE_PARTIAL_BASE:
            return self._accept_partial(pod, step, phase - PHASE_PARTIAL_BASE, leaf, offset, size)
        if self.plan.degraded:
            return self._accept_slot(pod, step, phase - PHASE_SLOT_BASE, leaf, offset, size)
        state = self._state(step)
        slot = state.slots[(phase, pod)]
        start, stop = slot.spans[leaf]
        per_chunk = self.plan.chunk_elems[leaf]
        if not start <= offset < stop or (offset - start) % per_chunk:
            raise InvalidChunk(f"leaf {leaf}: offset {offset} is not on the chunk grid of values [{start}, {stop}) "
                               f"that pod {pod} sends in phase {phase}")
        count = min(per_chunk, stop - offset)
        expected = self.plan.payload_bytes(leaf, count)
        if size != expected:
            raise InvalidChunk(f"leaf {leaf}: a chunk of {size} bytes at offset {offset}, expected {expected}")
        index = (offset - start) // per_chunk
        if index in slot.seen[leaf]:
            raise InvalidChunk(f"leaf {leaf}: duplicate chunk at offset {offset} of step {step}")
        slot.seen[leaf].add(index)
        own = None
        if phase == PHASE_WHOLE:
            own = state.own[leaf]
            if own is None:     # this pod's own values are not there yet: the step adds them later
                slot.unfused[leaf].append((offset, offset + count))
            else:
                own = own[offset:offset + count]
        return slot, slot.targets[leaf][offset - start:offset - start + count], own

    def _accept_slot(self, pod: int, step: int, slot_index: int, leaf: int, offset: int, size: int):
        host = self.plan.hosts[slot_index]
        if host != pod:
            raise InvalidChunk(f"slot {slot_index} is computed by pod {host}, not by pod {pod}")
        chunk = self.plan.slot_chunk(leaf, offset)
        if chunk is None:
            raise InvalidChunk(f"leaf {leaf}: offset {offset} is not on the chunk grid of slot {slot_index}")
        index, stop = chunk
        expected = self.plan.payload_bytes(leaf, stop - offset)
        if size != expected:
            raise InvalidChunk(f"leaf {leaf}: a chunk of {size} bytes at offset {offset} of slot {slot_index}, "
                               f"expected {expected}")
        slot = self._state(step).slots[(slot_phase(slot_index), pod)]
        if index in slot.seen[leaf]:
            raise InvalidChunk(f"leaf {leaf}: duplicate chunk at offset {offset} of slot {slot_index}, step {step}")
        slot.seen[leaf].add(index)
        return slot, slot.targets[leaf][offset:stop], None

    def _partial_slot(self, state: _StepState, slot_index: int, pod: int) -> _Slot:
        """The buffer of failed slot `slot_index`'s partial sum from `pod` in a step (made at first use)."""
        key = (partial_phase(slot_index), pod)
        if key not in state.slots:
            plan = self.plan
            sizes = plan.partial_sizes
            state.slots[key] = _Slot([(0, n) for n in sizes], [np.empty(n, PARTIAL_DTYPE) for n in sizes],
                                     [plan.partial_count(i) for i in range(len(sizes))])
        return state.slots[key]

    def _vote_slot(self, state: _StepState, pod: int) -> _Slot:
        """Where `pod`'s state vote for a step lands (made at first use)."""
        key = (PHASE_VOTE, pod)
        if key not in state.slots:
            state.slots[key] = _Slot([(0, 1)], [np.zeros(1, VOTE_DTYPE)], [1])
        return state.slots[key]

    def _accept_partial(self, pod: int, step: int, slot_index: int, leaf: int, offset: int, size: int):
        total = self.plan.partial_sizes[leaf]
        if not 0 <= offset < total or offset % self.plan.partial_elems:
            raise InvalidChunk(f"leaf {leaf}: offset {offset} is not on the grid of slot {slot_index}'s partial sums")
        count = min(self.plan.partial_elems, total - offset)
        if size != count * PARTIAL_DTYPE.itemsize:
            raise InvalidChunk(f"leaf {leaf}: a chunk of {size} bytes at offset {offset} of slot {slot_index}'s "
                               f"partial sum, expected {count * PARTIAL_DTYPE.itemsize}")
        slot = self._partial_slot(self._state(step), slot_index, pod)
        index = offset // self.plan.partial_elems
        if index in slot.seen[leaf]:
            raise InvalidChunk(f"leaf {leaf}: duplicate chunk at offset {offset} of slot {slot_index}'s partial sum, "
                               f"step {step}")
        slot.seen[leaf].add(index)
        return slot, slot.targets[leaf][offset:offset + count], None

    def receive(self, pod: int, step: int, phase: int, leaf: int, offset: int, payload) -> None:
        """One chunk from `pod` (authenticated by the transport). InvalidChunk if it does not fit;
        then nothing was written."""
        with self._cond:
            slot, target, own = self._accept(pod, step, phase, leaf, offset, len(payload))
        # Decode outside the lock: the chunk's place is reserved for it alone.
        if phase >= PHASE_PARTIAL_BASE:     # a partial sum: raw float32, whatever the compression
            target[...] = np.frombuffer(payload, PARTIAL_DTYPE, count=target.size)
        elif phase == PHASE_VOTE:
            target[...] = np.frombuffer(payload, VOTE_DTYPE, count=1)
        else:
            self.plan.codec.decode_into(payload, target, own)
        with self._cond:
            if phase < PHASE_PARTIAL_BASE and phase != PHASE_VOTE:     # the gradient itself
                state = self._steps.get(step)
                if state is not None:
                    now = time.monotonic()
                    state.first_chunk_at.setdefault(pod, now)
                    state.landed.append(now)
            slot.bytes += len(payload)
            slot.missing[leaf] -= 1
            if slot.missing[leaf] == 0:
                self._cond.notify_all()

    def abort(self, why: str) -> None:
        """Fail every wait, now and later, with ExchangeError(why); refuse every later chunk."""
        with self._cond:
            self._aborted = why or "the exchange was aborted"
            self._cond.notify_all()

    def refused_chunk(self, pod: int, why: str) -> None:
        with self._cond:
            self._refusals[pod] = why

    def lost(self, pod: int, steps: set[int], why: str) -> None:
        """A connection of `pod` broke: fail the `steps` it had delivered chunks to and that are
        not complete (its chunks cannot all arrive now)."""
        with self._cond:
            for step in steps:
                state = self._steps.get(step)
                if state is None:
                    continue
                slots = [s for (_, p), s in state.slots.items() if p == pod]
                if any(any(s.missing) for s in slots):
                    state.errors.setdefault(pod, f"{why} after {sum(s.bytes for s in slots)} bytes")
            self._cond.notify_all()

    def gone(self, pod: int, why: str) -> None:
        """Every data link of `pod` in this run has closed (the listener tells): a step waiting
        for its bytes fails at once, even if none came yet (it died between steps)."""
        with self._cond:
            self._gone.setdefault(pod, why)
            self._cond.notify_all()

    def _check_gone(self, step: int, pods) -> None:
        gone = {p: self._gone[p] for p in pods if p in self._gone}
        if gone:
            detail = "; ".join(f"pod {p}: {why}" for p, why in sorted(gone.items()))
            raise ExchangeError(f"step {step}: gradient exchange failed: {detail}")

    # -- from the step -----------------------------------------------------------------------------
    def set_own(self, step: int, leaf: int, values: np.ndarray) -> None:
        """2 pods: this pod's own (decoded) values of `leaf`, for peers' chunks to be added to."""
        with self._cond:
            self._state(step).own[leaf] = values

    def fail(self, step: int, pod: int, why: str) -> None:
        """Record that the exchange of `step` with `pod` failed (e.g. sending to it)."""
        with self._cond:
            state = self._steps.get(step)
            if state is not None:
                state.errors.setdefault(pod, why)
            self._cond.notify_all()

    def peers_began_at(self, step: int, pods) -> float | None:
        """When the last of `pods` had its first gradient chunk of `step` land here
        (time.monotonic()); None if one of them has sent none, or if `pods` is empty."""
        with self._cond:
            state = self._steps.get(step)
            times = [state.first_chunk_at.get(p) for p in pods] if state is not None else []
        known = [t for t in times if t is not None]
        return max(known) if known and len(known) == len(times) else None

    def first_landed_since(self, step: int, since: float) -> float | None:
        """When the first gradient chunk of `step` to land at or after `since` landed
        (time.monotonic()); None if none has."""
        with self._cond:
            state = self._steps.get(step)
            if state is None:
                return None
            index = bisect.bisect_left(state.landed, since)
            return state.landed[index] if index < len(state.landed) else None

    def wait_leaf(self, step: int, phase: int, leaf: int, deadline: float) -> dict[int, np.ndarray]:
        """Block until every peer's part of `leaf` in `phase` has arrived; returns it by pod.
        ExchangeError at the deadline, or as soon as any peer's part of the step has failed."""
        peers = {p: (phase, p) for p in range(self.num_pods) if p != self.pod_index}
        return self._wait(step, leaf, deadline, peers, "from", lambda p: f"pod {p}", lambda p: f"pod {p}")

    def wait_slots(self, step: int, leaf: int, deadline: float) -> dict[int, np.ndarray]:
        """Degraded mode: block until `leaf` of every slot another live pod hosts has arrived;
        returns it by slot. ExchangeError at the deadline, on abort, or as soon as any live
        peer's part of the step has failed (naming the slots it hosts)."""
        hosts = self.plan.hosts
        remote = {s: (slot_phase(s), h) for s, h in enumerate(hosts) if h != self.pod_index}
        return self._wait(step, leaf, deadline, remote, "of", lambda s: f"slot {s} from pod {hosts[s]}",
                          lambda p: f"pod {p} (computing slots {self._slots_of(p)})")

    def wait_votes(self, step: int, deadline: float) -> dict[int, int]:
        """Block until every other live pod's state vote for `step` has arrived; {pod: checksum}.
        ExchangeError as wait_slots."""
        peers = [p for p in self.plan.live if p != self.pod_index]
        with self._cond:
            state = self._state(step)
            for pod in peers:
                self._vote_slot(state, pod)
        got = self._wait(step, 0, deadline, {p: (PHASE_VOTE, p) for p in peers}, "from",
                         lambda p: f"the state vote of pod {p}", lambda p: f"pod {p}")
        return {p: int(v[0]) for p, v in got.items()}

    def wait_partial(self, step: int, slot: int, pod: int, leaf: int, deadline: float) -> np.ndarray:
        """Degraded mode, split: block until `leaf` of failed slot `slot`'s partial sum from live
        pod `pod` has arrived; returns it (flat float32). ExchangeError as wait_slots."""
        with self._cond:
            self._partial_slot(self._state(step), slot, pod)
        got = self._wait(step, leaf, deadline, {slot: (partial_phase(slot), pod)}, "of",
                         lambda s: f"slot {s}'s partial sum from pod {pod}",
                         lambda p: f"pod {p} (computing slots {self._slots_of(p)})")
        return got[slot]

    def _wait(self, step: int, leaf: int, deadline: float, sources: dict[int, tuple[int, int]], what: str,
              name: Callable[[int], str], failed: Callable[[int], str]) -> dict[int, np.ndarray]:
        """The wait of wait_leaf and wait_slots: block until `leaf` has arrived from every source
        (key -> the (phase, pod) it comes in); returns it by key. ExchangeError on abort, as soon
        as any pod's part of the step has failed or all its links are gone, or at the deadline.
        In messages `name(key)` names a source ("gradient {what} {name(key)} ... did not arrive")
        and `failed(pod)` a pod whose part failed."""
        with self._cond:
            state = self._state(step)
            while True:
                if self._aborted:
                    raise ExchangeError(self._aborted)
                if state.errors:
                    detail = "; ".join(f"{failed(p)}: {why}" for p, why in sorted(state.errors.items()))
                    raise ExchangeError(f"step {step}: gradient exchange failed: {detail}")
                slots = {k: state.slots[source] for k, source in sources.items()}
                missing = [k for k, got in slots.items() if got.missing[leaf] > 0]
                if not missing:
                    return {k: got.targets[leaf] for k, got in slots.items()}
                self._check_gone(step, {sources[k][1] for k in missing})
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    detail = ", ".join(f"{name(k)} ({slots[k].bytes} of its bytes so far, leaf {leaf} incomplete"
                                       f"{self._last_refusal(sources[k][1])})" for k in missing)
                    raise ExchangeError(f"step {step}: gradient {what} {detail} did not arrive within the DCN "
                                        f"deadline")
                self._cond.wait(remaining)

    def _last_refusal(self, pod: int) -> str:
        return f"; its last refused chunk: {self._refusals[pod]}" if pod in self._refusals else ""

    def _slots_of(self, pod: int) -> list[int]:
        return [s for s, h in enumerate(self.plan.hosts) if h == pod]
