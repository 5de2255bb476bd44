"""The cross-pod gradient exchange over the DCN link (worker <-> worker gRPC).

How a step's gradient travels:
  * The step thread takes the gradient leaves one at a time (their device->host copies were all
    started asynchronously, so later leaves are still copying while earlier ones are on the wire),
    encodes each into chunks of at most `chunk_bytes` and queues them for every peer. Each peer
    gets `streams` client streams per step; gRPC's own threads drain the queues, so sending
    overlaps encoding, copying and summing.
  * Incoming chunks are validated and decoded straight into buffers preallocated for the step
    (no join or copy of the whole payload).
  * 2 pods (phase 0): every pod sends its whole gradient to the other. As soon as both pods' copy
    of a leaf is complete, the leaf is summed in pod-index order and handed on (host->device).
  * N > 2 pods: reduce-scatter then all-gather. Pod p owns slice p of every leaf. Phase 1: every
    pod sends slice p of its gradient to pod p; pod p sums the slices in pod-index order. Phase 2:
    pod p sends its reduced slice to every pod, and every pod (p included) uses the owner's
    decoded bytes, so all pods end with bitwise-identical sums.
  * Compression (opt-in): bf16, or int8 with one float32 scale per chunk. Every pod sums the
    *decoded* values of every pod, its own included, so the result stays identical everywhere.
  * Slow-link mode: a token bucket (bandwidth) plus a fixed delay (latency) on this pod's egress.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import grpc
import ml_dtypes
import numpy as np

from multipod import protos
from multipod.pod_worker.config import COMPRESSIONS, effective_streams
from multipod.protos import codec, multipod_pb2 as pb
from multipod.protos.transport import open_channel

log = logging.getLogger(__name__)

# The wire enum (protos/multipod.proto DcnPhase), under short names.
PHASE_WHOLE = pb.DCN_PHASE_WHOLE      # 2 pods: the whole gradient
PHASE_REDUCE = pb.DCN_PHASE_REDUCE_SCATTER     # N > 2: the receiver's slice of the sender's gradient
PHASE_GATHER = pb.DCN_PHASE_ALL_GATHER     # N > 2: the sender's reduced slice


class InvalidChunk(ValueError):
    """A chunk that does not belong to any gradient this pod expects."""


class ExchangeError(RuntimeError):
    """The exchange of a step failed: a peer's gradient did not arrive complete within the
    deadline, a peer's stream broke off, or sending to a peer failed."""


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


# -- wire encodings ------------------------------------------------------------------------------
class WireCodec:
    """How one leaf's values travel: unchanged, as bf16, or as int8 with a per-chunk scale.

    encode() runs once on the sender; decode_into() runs on every pod that uses the chunk,
    the sender included, on the same bytes, so every pod sees the same decoded values."""

    def __init__(self, compression: str):
        if compression not in COMPRESSIONS:
            raise ValueError(f"dcn.compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.compression = compression

    def wire_dtype(self, leaf_dtype: np.dtype) -> np.dtype:
        if self.compression == "bf16":
            return np.dtype(ml_dtypes.bfloat16)
        if self.compression == "int8":
            return np.dtype(np.int8)
        return np.dtype(leaf_dtype)

    def encode(self, values: np.ndarray) -> tuple[np.ndarray, float]:
        """1-d values -> (wire array, scale). Scale is 0 unless int8."""
        if self.compression == "none":
            return values, 0.0
        if self.compression == "bf16":
            return values.astype(ml_dtypes.bfloat16), 0.0
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            # Non-finite values give a non-finite scale: every pod decodes non-finite values and
            # skips the update alike.
            peak = max(float(values.max()), -float(values.min())) if values.size else 0.0
            scale = np.float32(peak) / np.float32(127)
            if scale == 0 or not np.isfinite(scale):
                quantised = np.zeros(values.shape, np.int8)
            else:
                # |values / scale| <= 127 (up to rounding, which rint absorbs): no clip needed.
                scaled = np.divide(values, scale)
                quantised = np.rint(scaled, out=scaled).astype(np.int8)
        return quantised, float(scale)

    def decode_into(self, wire: np.ndarray, scale: float, out: np.ndarray) -> None:
        """Wire values -> `out` (a 1-d slice of a preallocated buffer of the leaf's dtype)."""
        if self.compression == "int8":
            with np.errstate(invalid="ignore", over="ignore"):
                np.multiply(wire, np.float32(scale), out=out, dtype=np.float32, casting="unsafe")
                if not math.isfinite(scale):
                    out[...] = np.float32(scale) * np.float32(0)   # NaN everywhere: the step is skipped
        else:
            out[...] = wire


def owned_ranges(size: int, num_pods: int) -> list[tuple[int, int]]:
    """The element range [start, stop) of a leaf that each pod reduces (N > 2 pods)."""
    bounds = [size * k // num_pods for k in range(num_pods + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(num_pods)]


class Plan:
    """Who sends what to whom: a pure function of (num_pods, leaves, chunk_bytes, compression),
    identical on every pod (the config hash is checked before training starts)."""

    def __init__(self, num_pods: int, leaves: list[LeafSpec], chunk_bytes: int, compression: str):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.num_pods = num_pods
        self.leaves = leaves
        self.codec = WireCodec(compression)
        self.wire_dtypes = [self.codec.wire_dtype(l.dtype) for l in leaves]
        self.chunk_elems = [max(1, chunk_bytes // d.itemsize) for d in self.wire_dtypes]
        self.whole = num_pods <= 2
        self.ranges = [owned_ranges(l.size, num_pods) for l in leaves]
        self.total_bytes = sum(l.nbytes for l in leaves)

    def span(self, phase: int, sender: int, receiver: int, leaf: int) -> tuple[int, int]:
        """The element range of `leaf` that `sender` sends `receiver` in `phase`."""
        if phase == PHASE_WHOLE:
            return 0, self.leaves[leaf].size
        if phase == PHASE_REDUCE:
            return self.ranges[leaf][receiver]
        return self.ranges[leaf][sender]

    def phases(self) -> tuple[int, ...]:
        return (PHASE_WHOLE,) if self.whole else (PHASE_REDUCE, PHASE_GATHER)

    def chunks(self, leaf: int, start: int, stop: int):
        """(chunk index, start, stop) of the fixed chunk grid over [start, stop)."""
        step = self.chunk_elems[leaf]
        for index, a in enumerate(range(start, stop, step)):
            yield index, a, min(a + step, stop)


# -- receiving -----------------------------------------------------------------------------------
class _Slot:
    """What one peer sends this pod in one phase of one step: one target per leaf."""

    def __init__(self, plan: Plan, spans: list[tuple[int, int]], targets: list[np.ndarray]):
        self.spans = spans
        self.targets = targets
        self.seen = [set() for _ in spans]
        self.missing = [math.ceil((b - a) / plan.chunk_elems[i]) for i, (a, b) in enumerate(spans)]
        self.bytes = 0
        self.unfused: list[list[tuple[int, int]]] = [[] for _ in spans]   # 2 pods: ranges still to add


class _StepState:
    """Everything this pod receives for one step, allocated when the step's first chunk (or the
    step itself) arrives."""

    def __init__(self, plan: Plan, pod: int):
        self.errors: dict[int, str] = {}       # pod -> why its part of the step failed
        self.slots: dict[tuple[int, int], _Slot] = {}
        peers = [p for p in range(plan.num_pods) if p != pod]
        # The result. 2 pods: the peer's chunks are added to this pod's own values as they arrive
        # (own + peer == peer + own bitwise: IEEE addition commutes), so the sum is done when the
        # last chunk lands. N > 2: the all-gather writes every owner's reduced slice into it.
        self.output = [np.empty(l.size, l.dtype) for l in plan.leaves]
        self.own: list[np.ndarray | None] = [None] * len(plan.leaves)   # 2 pods: this pod's values
        for phase in plan.phases():
            for peer in peers:
                spans = [plan.span(phase, peer, pod, i) for i in range(len(plan.leaves))]
                if phase in (PHASE_GATHER, PHASE_WHOLE):
                    targets = [self.output[i][a:b] for i, (a, b) in enumerate(spans)]
                else:
                    targets = [np.empty(b - a, l.dtype) for (a, b), l in zip(spans, plan.leaves)]
                self.slots[(phase, peer)] = _Slot(plan, spans, targets)


class Inbox:
    """Receives peers' gradient chunks and hands complete leaves to the step.

    Thread-safe: gRPC handler threads call receive(); the step thread calls wait_leaf()."""

    def __init__(self, run_id: str, pod_index: int, num_pods: int, leaves: list[LeafSpec],
                 chunk_bytes: int = 2 << 20, compression: str = "none"):
        self.run_id = run_id
        self.pod_index = pod_index
        self.num_pods = num_pods
        self.leaves = leaves
        self.plan = Plan(num_pods, leaves, chunk_bytes, compression)
        self._cond = threading.Condition()
        self._steps: dict[int, _StepState] = {}
        self._next_step = 0    # the step this pod will complete next

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

    def _check_sender(self, chunk: pb.GradientChunk) -> None:
        if chunk.protocol_version != protos.PROTOCOL_VERSION:
            raise InvalidChunk(f"protocol version {chunk.protocol_version} != {protos.PROTOCOL_VERSION}")
        if chunk.run_id != self.run_id:
            raise InvalidChunk(f"chunk of run {chunk.run_id!r}, this pod is in run {self.run_id!r}")
        if chunk.from_pod >= self.num_pods or chunk.from_pod == self.pod_index:
            raise InvalidChunk(f"from_pod {chunk.from_pod} is not a peer of pod {self.pod_index} "
                               f"(pods 0..{self.num_pods - 1})")

    def _accept(self, chunk: pb.GradientChunk, size: int):
        """Validate a chunk's header and reserve its place; returns where to decode it to."""
        self._check_sender(chunk)
        if chunk.phase not in self.plan.phases():
            raise InvalidChunk(f"phase {chunk.phase} is not used with {self.num_pods} pods "
                               f"(expected one of {self.plan.phases()})")
        leaf = chunk.leaf_index
        if leaf >= len(self.leaves):
            raise InvalidChunk(f"leaf_index {leaf} out of range (gradient has {len(self.leaves)} leaves)")
        spec = self.leaves[leaf]
        if tuple(chunk.shape) != spec.shape:
            raise InvalidChunk(f"leaf {leaf}: shape {tuple(chunk.shape)} != expected {spec.shape}")
        try:
            dtype = codec.dtype_from_name(chunk.dtype)
        except codec.CodecError as exc:
            raise InvalidChunk(f"leaf {leaf}: {exc}") from None
        wire = self.plan.wire_dtypes[leaf]
        if dtype != wire:
            raise InvalidChunk(f"leaf {leaf}: wire dtype {dtype.name} != expected {wire.name}")
        state = self._state(chunk.step)
        slot = state.slots[(chunk.phase, chunk.from_pod)]
        start, stop = slot.spans[leaf]
        if chunk.offset % wire.itemsize:
            raise InvalidChunk(f"leaf {leaf}: offset {chunk.offset} is not a multiple of {wire.itemsize}")
        elem = chunk.offset // wire.itemsize
        step_elems = self.plan.chunk_elems[leaf]
        if not start <= elem < stop or (elem - start) % step_elems:
            raise InvalidChunk(f"leaf {leaf}: offset {chunk.offset} is not on the chunk grid of "
                               f"elements [{start}, {stop}) that pod {chunk.from_pod} sends in phase {chunk.phase}")
        count = min(step_elems, stop - elem)
        if size != count * wire.itemsize:
            raise InvalidChunk(f"leaf {leaf}: chunk of {size} bytes at offset {chunk.offset}, "
                               f"expected {count * wire.itemsize}")
        if self.plan.codec.compression != "int8" and chunk.scale != 0:
            raise InvalidChunk(f"leaf {leaf}: scale {chunk.scale} on an uncompressed chunk")
        index = (elem - start) // step_elems
        if index in slot.seen[leaf]:
            raise InvalidChunk(f"leaf {leaf}: duplicate chunk at offset {chunk.offset} from pod {chunk.from_pod}")
        slot.seen[leaf].add(index)
        own = None
        if chunk.phase == PHASE_WHOLE:
            own = state.own[leaf]
            if own is None:     # this pod's own values are not there yet: the step adds them later
                slot.unfused[leaf].append((elem, elem + count))
            else:
                own = own[elem:elem + count]
        return state, slot, leaf, slot.targets[leaf][elem - start:elem - start + count], wire, own

    def receive(self, chunks) -> pb.PushAck:
        """Consume one peer stream. Raises InvalidChunk for anything malformed; a refused chunk
        writes nothing. A stream that breaks off after delivering part of a step fails that step
        at once (the waiting pod does not sit out the deadline)."""
        count = nbytes = 0
        touched: dict[tuple[int, int], _StepState] = {}
        ended = False
        try:
            for chunk in chunks:
                if ended:
                    raise InvalidChunk("a chunk after the stream's end marker")
                if chunk.last:
                    with self._cond:
                        self._check_sender(chunk)
                        # The receiver may already have finished the step (it had every byte it
                        # needs) when the marker arrives: that is fine.
                        if chunk.step >= self._next_step:
                            self._state(chunk.step)
                    ended = True
                    continue
                with self._cond:
                    data = chunk.data   # every access to a bytes field copies it: once only
                    state, slot, leaf, target, wire, own = self._accept(chunk, len(data))
                    touched[(chunk.step, chunk.from_pod)] = state
                # Decode outside the lock: the chunk's place is reserved for this stream alone.
                values = np.frombuffer(data, wire)
                if own is not None and self.plan.codec.compression == "none":
                    np.add(own, values, out=target)     # decode and sum in one pass
                else:
                    self.plan.codec.decode_into(values, chunk.scale, target)
                    if own is not None:
                        target += own
                with self._cond:
                    slot.bytes += len(data)
                    slot.missing[leaf] -= 1
                    if slot.missing[leaf] == 0:
                        self._cond.notify_all()
                count += 1
                nbytes += len(data)
            if not ended:
                # gRPC may end a cancelled stream like a finished one: only the marker tells.
                raise InvalidChunk("the stream ended without its end marker (the sender broke off)")
            return pb.PushAck(chunks=count, bytes=nbytes)
        except BaseException as exc:
            # Refused chunks and streams the peer broke off (gRPC raises on iteration).
            why = str(exc) if isinstance(exc, InvalidChunk) else f"{type(exc).__name__} {exc}".strip()
            with self._cond:
                for (_step, peer), state in touched.items():
                    state.errors.setdefault(peer, f"its stream broke off after {nbytes} bytes ({why})")
                self._cond.notify_all()
            raise

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

    def wait_leaf(self, step: int, phase: int, leaf: int, deadline: float) -> dict[int, np.ndarray]:
        """Block until every peer's part of `leaf` in `phase` has arrived; returns it by pod.
        ExchangeError at the deadline, or as soon as any peer's part of the step has failed."""
        peers = [p for p in range(self.num_pods) if p != self.pod_index]
        with self._cond:
            state = self._state(step)
            while True:
                if state.errors:
                    detail = "; ".join(f"pod {p}: {why}" for p, why in sorted(state.errors.items()))
                    raise ExchangeError(f"step {step}: gradient exchange failed: {detail}")
                slots = {p: state.slots[(phase, p)] for p in peers}
                missing = [p for p, s in slots.items() if s.missing[leaf] > 0]
                if not missing:
                    return {p: s.targets[leaf] for p, s in slots.items()}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    detail = ", ".join(
                        f"pod {p} ({slots[p].bytes} of its bytes so far, leaf {leaf} incomplete)" for p in missing)
                    raise ExchangeError(f"step {step}: gradient from {detail} did not arrive within the DCN "
                                        f"deadline")
                self._cond.wait(remaining)


# -- sending -------------------------------------------------------------------------------------
class Pacer:
    """Slow-link simulation on one pod's egress: a token bucket of `gbps` and a fixed one-way
    delay of `latency_s` added to every chunk (0 disables each)."""

    def __init__(self, gbps: float = 0.0, latency_s: float = 0.0, burst_bytes: int = 256 << 10):
        self.bytes_per_s = gbps * 1e9 / 8 if gbps > 0 else 0.0
        self.latency_s = latency_s
        self.burst_bytes = burst_bytes
        self._lock = threading.Lock()
        self._free_at = 0.0     # when the simulated link has sent everything queued so far

    @property
    def active(self) -> bool:
        return self.bytes_per_s > 0 or self.latency_s > 0

    def wait(self, nbytes: int, queued_at: float) -> None:
        """Sleep until a chunk of `nbytes` queued at `queued_at` would have crossed the link."""
        now = time.monotonic()
        ready = queued_at + self.latency_s
        if self.bytes_per_s > 0:
            with self._lock:
                # The link serialises chunks: each starts when the previous one has left.
                begin = max(self._free_at, now - self.burst_bytes / self.bytes_per_s)
                self._free_at = begin + nbytes / self.bytes_per_s
                ready = max(ready, self._free_at)
        if ready > now:
            time.sleep(ready - now)


@dataclass
class ExchangeStats:
    """What one step's exchange cost this pod."""
    bytes_sent: int = 0        # payload bytes this pod put on the wire this step (after encoding)
    bytes_received: int = 0
    idle_s: float = 0.0        # time the step thread sat waiting on peers' chunks


_END = object()
PUSH_METHOD = "/multipod.Dcn/PushGradients"
_DATA_TAG = bytes([(pb.GradientChunk.DESCRIPTOR.fields_by_name["data"].number << 3) | 2])


_MALLOC_TUNED = False


def tune_malloc() -> None:
    """Keep freed chunk-sized buffers in the process heap (glibc only; a no-op elsewhere).

    Every step allocates and frees a gradient's worth of 1-4 MiB buffers (serialised chunks,
    gRPC messages). By default glibc serves each from a fresh mmap and unmaps it on free, so every
    step pays a page fault per 4 KiB touched: measured here, copying 100 MB into fresh 2 MiB
    buffers took 3-5x longer than into reused heap memory."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 << 20)    # M_MMAP_THRESHOLD: serve blocks below 256 MiB from the heap
        libc.mallopt(-1, 1 << 30)      # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap
    except (OSError, AttributeError):
        pass


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _with_data(header: pb.GradientChunk, data: memoryview) -> bytes:
    """The serialised GradientChunk `header` with `data` as its data field, built with one copy
    of the payload (protobuf would copy it into the message and again when serialising). Fields
    may come in any order on the wire, so appending the data field is a valid encoding."""
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint(len(data)), data))


class _Outgoing:
    """This step's streams to the peers: `streams` gRPC client streams per peer, fed by queues
    that gRPC's own threads drain."""

    def __init__(self, exchange: Exchange, step: int, deadline: float):
        self.exchange = exchange
        self.step = step
        self.aborted = threading.Event()
        self.bytes_sent = 0         # payload bytes queued for the peers (the step thread counts)
        self._queues: dict[int, list[queue.SimpleQueue]] = {}
        self._turn: dict[int, int] = {}
        self._calls = []
        timeout = max(0.001, deadline - time.monotonic())
        for peer, stub in exchange._stubs.items():
            self._queues[peer] = [queue.SimpleQueue() for _ in range(exchange.streams)]
            self._turn[peer] = 0
            for q in self._queues[peer]:
                call = stub.future(self._feed(q), timeout=timeout)
                call.add_done_callback(lambda f, peer=peer: self._done(peer, f))
                self._calls.append((peer, call))

    def _feed(self, q: queue.SimpleQueue):
        ex = self.exchange
        while True:
            try:
                item = q.get(timeout=0.25)
            except queue.Empty:
                if self.aborted.is_set():
                    return
                continue
            if self.aborted.is_set():
                return      # no end marker: the receiver fails the step at once
            if item is _END:
                yield pb.GradientChunk(protocol_version=protos.PROTOCOL_VERSION, run_id=ex.run_id,
                                       from_pod=ex.pod_index, step=self.step, last=True).SerializeToString()
                return
            phase, leaf, offset, wire, scale, queued_at = item
            data = memoryview(np.ascontiguousarray(wire).view(np.uint8))
            if ex.pacer.active:
                ex.pacer.wait(len(data), queued_at)
            header = pb.GradientChunk(
                protocol_version=protos.PROTOCOL_VERSION, run_id=ex.run_id, from_pod=ex.pod_index,
                step=self.step, leaf_index=leaf, dtype=codec.dtype_name(wire.dtype),
                shape=ex.plan.leaves[leaf].shape, offset=offset, scale=scale, phase=phase)
            yield _with_data(header, data)

    def _done(self, peer: int, future) -> None:
        if future.cancelled() or self.aborted.is_set():
            return
        exc = future.exception()
        if exc is not None:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
            # The step may already be done here (acks drain after it): then the peer fails its own.
            log.warning("step %d: sending the gradient to pod %d failed: %s", self.step, peer, detail)
            self.exchange.inbox.fail(self.step, peer, f"sending to it at {self.exchange.peer_addresses[peer]} "
                                                      f"failed ({detail})")

    def put(self, peer: int, phase: int, leaf: int, offset_elems: int, wire: np.ndarray, scale: float) -> None:
        """Queue one chunk for a peer (round-robin over that peer's streams)."""
        qs = self._queues[peer]
        turn = self._turn[peer]
        self._turn[peer] = turn + 1
        qs[turn % len(qs)].put((phase, leaf, offset_elems * wire.dtype.itemsize, wire, scale, time.monotonic()))
        self.bytes_sent += wire.nbytes

    def finish(self) -> None:
        """No more chunks this step: end every stream once its queue is drained."""
        for qs in self._queues.values():
            for q in qs:
                q.put(_END)

    def abort(self) -> None:
        self.aborted.set()
        for _, call in self._calls:
            call.cancel()


class Exchange:
    """This pod's side of the link: an Inbox for peers' chunks and streams to send its own."""

    def __init__(self, run_id: str, pod_index: int, peer_addresses: list[str], leaves: list[LeafSpec],
                 chunk_bytes: int, timeout_s: float, *, streams: int = 1, compression: str = "none",
                 link_gbps: float = 0.0, link_latency_ms: float = 0.0, dcn=None):
        """`dcn` (a DcnConfig) overrides chunk_bytes, timeout_s and the keyword settings."""
        if dcn is not None:
            chunk_bytes, timeout_s, streams = dcn.chunk_bytes, dcn.timeout_s, dcn.streams
            compression, link_gbps, link_latency_ms = dcn.compression, dcn.link_gbps, dcn.link_latency_ms
        if streams < 1:
            raise ValueError("streams must be >= 1")
        tune_malloc()
        self.run_id = run_id
        self.pod_index = pod_index
        self.num_pods = len(peer_addresses)
        self.peer_addresses = peer_addresses
        self.timeout_s = timeout_s
        # A stream's handler holds one of the peer's server threads until the stream ends
        # (pod_worker/config.py effective_streams says how many fit).
        self.streams = effective_streams(streams, self.num_pods)
        self.inbox = Inbox(run_id, pod_index, self.num_pods, leaves, chunk_bytes, compression)
        self.plan = self.inbox.plan
        self.pacer = Pacer(link_gbps, link_latency_ms / 1e3)
        self._outgoing: _Outgoing | None = None     # the latest step's streams (they may still drain)
        self._channels = {p: open_channel(a) for p, a in enumerate(peer_addresses) if p != pod_index}
        # Chunks go out pre-serialised (see _with_data), so the stream takes bytes as they are.
        self._stubs = {p: c.stream_unary(PUSH_METHOD, request_serializer=None,
                                         response_deserializer=pb.PushAck.FromString)
                       for p, c in self._channels.items()}

    def close(self) -> None:
        if self._outgoing is not None:
            self._outgoing.abort()
        for channel in self._channels.values():
            channel.close()

    def _encode(self, values: np.ndarray, leaf: int, start: int, stop: int, send, decoded: np.ndarray | None):
        """Encode values[start:stop] chunk by chunk; send(offset, wire, scale) each chunk, and
        decode it into `decoded` (same length as the span) when this pod uses the values too."""
        for _, a, b in self.plan.chunks(leaf, start, stop):
            wire, scale = self.plan.codec.encode(values[a:b])
            send(a, wire, scale)
            if decoded is not None:
                self.plan.codec.decode_into(wire, scale, decoded[a - start:b - start])

    def all_reduce(self, step: int, leaves, on_leaf=None) -> tuple[list, ExchangeStats]:
        """Send this pod's gradient leaves, receive the peers', and return the sum over all pods in
        pod-index order, bitwise identical on every pod.

        `leaves` are host arrays or device arrays whose host copies are under way; each is read
        only when its turn comes. `on_leaf(index, summed)` (e.g. an async host->device put) is
        called on each leaf as soon as it is summed; its results are returned."""
        on_leaf = on_leaf or (lambda index, value: value)
        plan = self.plan
        stats = ExchangeStats()
        deadline = time.monotonic() + self.timeout_s
        state = self.inbox.state(step)
        out = self._outgoing = _Outgoing(self, step, deadline)
        me, peers = self.pod_index, sorted(self._stubs)
        results = []
        try:
            def wait(phase, leaf):
                t = time.monotonic()
                got = self.inbox.wait_leaf(step, phase, leaf, deadline)
                stats.idle_s += time.monotonic() - t
                return got

            if plan.whole:
                own = []
                for i, leaf in enumerate(leaves):
                    values = np.asarray(leaf).reshape(-1)    # waits for this leaf's copy only
                    send = lambda a, w, s, i=i: [out.put(p, PHASE_WHOLE, i, a, w, s) for p in peers]
                    if plan.codec.compression == "none":
                        mine = values
                        self.inbox.set_own(step, i, mine)
                        self._encode(values, i, 0, values.size, send, None)
                    else:
                        mine = np.empty(values.size, values.dtype)
                        self._encode(values, i, 0, values.size, send, mine)
                        self.inbox.set_own(step, i, mine)
                    own.append(mine)
                out.finish()
                (peer,) = peers
                for i, spec in enumerate(plan.leaves):
                    wait(PHASE_WHOLE, i)
                    total = state.output[i]
                    # Chunks that arrived before this pod's own values: add them now.
                    for a, b in state.slots[(PHASE_WHOLE, peer)].unfused[i]:
                        total[a:b] += own[i][a:b]
                    results.append(on_leaf(i, total.reshape(spec.shape)))
            else:
                own = []
                for i, leaf in enumerate(leaves):
                    values = np.asarray(leaf).reshape(-1)
                    for p in range(self.num_pods):
                        a, b = plan.ranges[i][p]
                        if p == me:
                            mine = values[a:b] if plan.codec.compression == "none" else np.empty(b - a, values.dtype)
                            self._encode(values, i, a, b, lambda *_: None,
                                         None if plan.codec.compression == "none" else mine)
                            own.append(mine)
                        else:
                            self._encode(values, i, a, b,
                                         lambda o, w, s, p=p, i=i: out.put(p, PHASE_REDUCE, i, o, w, s), None)
                a_b = [plan.ranges[i][me] for i in range(len(plan.leaves))]
                for i in range(len(plan.leaves)):
                    got = wait(PHASE_REDUCE, i)
                    got[me] = own[i]
                    a, b = a_b[i]
                    reduced = np.add(got[0], got[1])
                    for p in range(2, self.num_pods):
                        reduced += got[p]
                    # Every pod, this one included, uses the decoded bytes of the owner's slice.
                    target = state.output[i][a:b]
                    self._encode(reduced, i, 0, b - a,
                                 lambda o, w, s, i=i, a=a: [out.put(p, PHASE_GATHER, i, o + a, w, s) for p in peers],
                                 target)
                out.finish()
                for i, spec in enumerate(plan.leaves):
                    wait(PHASE_GATHER, i)
                    results.append(on_leaf(i, state.output[i].reshape(spec.shape)))
            # Not waiting for the peers' acknowledgements: every byte they need is queued, and a
            # peer that does not get it fails its own step (the controller then stops the run).
            # The streams drain while this pod applies the update.
        except BaseException:
            out.abort()
            raise
        stats.bytes_sent = out.bytes_sent
        stats.bytes_received = sum(s.bytes for s in state.slots.values())
        return results, stats
