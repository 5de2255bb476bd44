"""The cross-pod gradient exchange over the DCN link (worker <-> worker gRPC).

Every pod streams its whole gradient, leaf by leaf, in chunks of `dcn.chunk_bytes`, to every peer
(one client stream per peer and step). Incoming chunks are validated and written straight into
buffers preallocated for the sending pod; nothing is joined or copied as a whole. Once every
peer's gradient for a step is complete, the pods sum them in pod-index order, so every pod adds
identical bytes in an identical order and gets a bitwise-identical result.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

import protos
from protos import codec, multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from protos.transport import open_channel

log = logging.getLogger(__name__)


class InvalidChunk(ValueError):
    """A chunk that does not belong to any gradient this pod expects."""


class ExchangeError(RuntimeError):
    """A peer's gradient did not arrive complete within the deadline."""


@dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one gradient leaf, as it travels on the wire."""
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class _Incoming:
    """One peer's gradient for one step, being filled chunk by chunk."""
    buffers: list[np.ndarray]
    filled: list[int]          # bytes written so far, per leaf (chunks arrive in order)
    complete: bool = False
    error: str | None = None
    streaming: bool = True
    bytes: int = 0


@dataclass
class ExchangeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    send_s: float = 0.0
    wait_s: float = 0.0
    extra: dict = field(default_factory=dict)


class Inbox:
    """Receives peers' gradient streams and hands complete gradients to the step.

    Thread-safe: gRPC handler threads call receive(); the step thread calls wait().
    """

    def __init__(self, run_id: str, pod_index: int, num_pods: int, leaves: list[LeafSpec]):
        self.run_id = run_id
        self.pod_index = pod_index
        self.num_pods = num_pods
        self.leaves = leaves
        self._cond = threading.Condition()
        self._incoming: dict[tuple[int, int], _Incoming] = {}
        self._next_step = 0    # the step this pod will complete next

    def set_next_step(self, step: int) -> None:
        """The pod is now working towards `step`: drop anything older (it can no longer be used)."""
        with self._cond:
            self._next_step = step
            for key in [k for k in self._incoming if k[0] < step]:
                del self._incoming[key]
            self._cond.notify_all()

    def _check_header(self, chunk: pb.GradientChunk) -> tuple[int, int]:
        if chunk.protocol_version != protos.PROTOCOL_VERSION:
            raise InvalidChunk(f"protocol version {chunk.protocol_version} != {protos.PROTOCOL_VERSION}")
        if chunk.run_id != self.run_id:
            raise InvalidChunk(f"chunk of run {chunk.run_id!r}, this pod is in run {self.run_id!r}")
        if chunk.from_pod >= self.num_pods or chunk.from_pod == self.pod_index:
            raise InvalidChunk(f"from_pod {chunk.from_pod} is not a peer of pod {self.pod_index} "
                               f"(pods 0..{self.num_pods - 1})")
        # A peer can be at most one step ahead: it cannot finish step s without our gradient.
        if not self._next_step <= chunk.step <= self._next_step + 1:
            raise InvalidChunk(f"chunk for step {chunk.step}, this pod expects step {self._next_step}"
                               f" or {self._next_step + 1}")
        if chunk.phase != 0:
            raise InvalidChunk(f"unknown phase {chunk.phase}")
        return chunk.step, chunk.from_pod

    def _write(self, entry: _Incoming, chunk: pb.GradientChunk) -> None:
        if chunk.leaf_index >= len(self.leaves):
            raise InvalidChunk(f"leaf_index {chunk.leaf_index} out of range (gradient has {len(self.leaves)} leaves)")
        spec = self.leaves[chunk.leaf_index]
        if tuple(chunk.shape) != spec.shape:
            raise InvalidChunk(f"leaf {chunk.leaf_index}: shape {tuple(chunk.shape)} != expected {spec.shape}")
        try:
            dtype = codec.dtype_from_name(chunk.dtype)
        except codec.CodecError as exc:
            raise InvalidChunk(f"leaf {chunk.leaf_index}: {exc}") from None
        if dtype != spec.dtype:
            raise InvalidChunk(f"leaf {chunk.leaf_index}: dtype {dtype.name} != expected {spec.dtype.name}")
        filled = entry.filled[chunk.leaf_index]
        if chunk.offset != filled:
            raise InvalidChunk(f"leaf {chunk.leaf_index}: chunk at offset {chunk.offset}, expected {filled}")
        end = filled + len(chunk.data)
        if end > spec.nbytes or not chunk.data:
            raise InvalidChunk(f"leaf {chunk.leaf_index}: chunk of {len(chunk.data)} bytes at {filled} "
                               f"does not fit the leaf's {spec.nbytes} bytes")
        # Straight into the preallocated buffer: no join of the whole payload.
        entry.buffers[chunk.leaf_index].reshape(-1).view(np.uint8)[filled:end] = np.frombuffer(chunk.data, np.uint8)
        entry.filled[chunk.leaf_index] = end
        entry.bytes += len(chunk.data)

    def receive(self, chunks) -> pb.PushAck:
        """Consume one peer stream. Raises InvalidChunk for anything malformed; what was written
        by a refused stream is discarded, so it cannot corrupt the step."""
        key = None
        count = 0
        try:
            for chunk in chunks:
                with self._cond:
                    chunk_key = self._check_header(chunk)
                    if key is None:
                        key = chunk_key
                        if key in self._incoming:
                            key = None  # not ours to discard
                            raise InvalidChunk(f"duplicate gradient stream from pod {chunk.from_pod} "
                                               f"for step {chunk.step}")
                        self._incoming[key] = _Incoming(
                            buffers=[np.empty(s.shape, s.dtype) for s in self.leaves],
                            filled=[0] * len(self.leaves))
                    elif chunk_key != key:
                        raise InvalidChunk("a stream must carry one pod's gradient for one step")
                    self._write(self._incoming[key], chunk)
                count += 1
            with self._cond:
                if key is None:
                    raise InvalidChunk("empty gradient stream")
                entry = self._incoming.get(key)
                if entry is None:   # dropped by set_next_step meanwhile: a stale stream
                    raise InvalidChunk(f"step {key[0]} is no longer expected")
                missing = sum(s.nbytes for s in self.leaves) - entry.bytes
                if missing:
                    raise InvalidChunk(f"gradient stream from pod {key[1]} for step {key[0]} ended "
                                       f"{missing} bytes short")
                entry.complete = True
                entry.streaming = False
                self._cond.notify_all()
                return pb.PushAck(chunks=count, bytes=entry.bytes)
        except BaseException:
            # Covers refused chunks and streams the peer broke off (gRPC raises on iteration).
            with self._cond:
                if key is not None and key in self._incoming and not self._incoming[key].complete:
                    del self._incoming[key]
                self._cond.notify_all()
            raise

    def wait(self, step: int, deadline: float) -> dict[int, list[np.ndarray]]:
        """Block until every peer's gradient for `step` is complete; ExchangeError at the deadline,
        naming the pods still missing."""
        peers = [p for p in range(self.num_pods) if p != self.pod_index]
        with self._cond:
            while True:
                done = {p: self._incoming.get((step, p)) for p in peers}
                missing = [p for p, e in done.items() if e is None or not e.complete]
                if not missing:
                    return {p: e.buffers for p, e in done.items()}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    detail = ", ".join(
                        f"pod {p} ({'partial: %d bytes' % self._incoming[(step, p)].bytes if (step, p) in self._incoming else 'nothing received'})"
                        for p in missing)
                    raise ExchangeError(f"step {step}: gradient from {detail} did not arrive within the DCN deadline")
                self._cond.wait(remaining)


def chunk_stream(run_id: str, pod_index: int, step: int, leaves: list[np.ndarray], chunk_bytes: int):
    """Yield GradientChunks for a pod's gradient, leaf by leaf, at most chunk_bytes each."""
    for index, leaf in enumerate(leaves):
        raw = memoryview(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        name = codec.dtype_name(leaf.dtype)
        for offset in range(0, len(raw), chunk_bytes):
            yield pb.GradientChunk(
                protocol_version=protos.PROTOCOL_VERSION, run_id=run_id, from_pod=pod_index,
                step=step, leaf_index=index, dtype=name, shape=leaf.shape, offset=offset,
                data=bytes(raw[offset:offset + chunk_bytes]))


class Exchange:
    """This pod's side of the link: an Inbox for peers' gradients and stubs to send its own."""

    def __init__(self, run_id: str, pod_index: int, peer_addresses: list[str], leaves: list[LeafSpec],
                 chunk_bytes: int, timeout_s: float):
        self.run_id = run_id
        self.pod_index = pod_index
        self.num_pods = len(peer_addresses)
        self.peer_addresses = peer_addresses
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.inbox = Inbox(run_id, pod_index, self.num_pods, leaves)
        self._channels = {p: open_channel(a)
                          for p, a in enumerate(peer_addresses) if p != pod_index}
        self._stubs = {p: pb_grpc.DcnStub(c) for p, c in self._channels.items()}
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, self.num_pods - 1),
                                                           thread_name_prefix="dcn-send")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels.values():
            channel.close()

    def _send(self, peer: int, step: int, leaves: list[np.ndarray]) -> int:
        stream = chunk_stream(self.run_id, self.pod_index, step, leaves, self.chunk_bytes)
        try:
            ack = self._stubs[peer].PushGradients(stream, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise ExchangeError(f"step {step}: sending the gradient to pod {peer} at "
                                f"{self.peer_addresses[peer]} failed: {exc.code().name}: {exc.details()}") from None
        return ack.bytes

    def all_reduce(self, step: int, leaves: list[np.ndarray]) -> tuple[list[np.ndarray], ExchangeStats]:
        """Send this pod's gradient leaves to every peer, receive theirs, and return the sum over
        all pods in pod-index order (bitwise identical on every pod)."""
        stats = ExchangeStats()
        start = time.monotonic()
        deadline = start + self.timeout_s
        sends = [self._pool.submit(self._send, p, step, leaves) for p in self._stubs]
        received = self.inbox.wait(step, deadline)
        for future in sends:
            stats.bytes_sent += future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        stats.wait_s = time.monotonic() - start
        stats.bytes_received = sum(l.nbytes for l in leaves) * len(received)
        received[self.pod_index] = leaves
        summed = []
        for index in range(len(leaves)):
            total = np.array(received[0][index], copy=True)
            for pod in range(1, self.num_pods):
                total += received[pod][index]
            summed.append(total)
        return summed, stats
