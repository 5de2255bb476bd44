"""State transfer: a live pod (the donor) streams its parameters and optimizer state to a
rejoining pod over the data plane, on connections whose run id is the transfer id (so the HMAC
handshake of transport.py binds them to this transfer and to the donor's pod index).

  1. Manifest (PHASE_STATE_MANIFEST): header.step = the state's step, header.leaf = its number
     of leaves, header.offset = its bytes; payload = its fingerprint, ASCII. The donor repeats it
     (backing off) until the receiver acknowledges it: the rejoining pod attaches its
     StateReceiver to its listener when its own request arrives, which may be after the donor
     has connected, and frames of a run the listener is not serving are dropped.
  2. Every leaf's raw bytes (no compression: the state arrives exact), PHASE_STATE, on the grid
     of chunk_bytes // itemsize values per chunk, round-robin over `streams` connections.
  3. The receiver acknowledges the chunk that completes the state ("complete"); send_state
     returns then. A chunk the receiver refuses is answered with the reason, so the donor fails
     at once rather than at its deadline.

The receiver writes into staging buffers of its own, never into the live state, and hands them
out only once complete. It does not check the fingerprint: the caller must hash what wait()
returns with its own function and load it only if that matches the donor's fingerprint.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from multipod import protos
from multipod.pod_worker.dcn.connection import Connection, receive_any
from multipod.pod_worker.dcn.inbox import InvalidChunk
from multipod.pod_worker.dcn.plan import PHASE_STATE, PHASE_STATE_MANIFEST, LeafSpec
from multipod.pod_worker.dcn.transport import ACK, HEADER, REFUSED, LinkError

MAX_FINGERPRINT_BYTES = 1024
_MANIFEST_ACK, _COMPLETE_ACK = b"manifest", b"complete"


class TransferError(RuntimeError):
    """A state transfer did not complete: refused, cut off, or not done by the deadline."""


@dataclass
class TransferStats:
    bytes: int          # the state's bytes sent (the manifest aside)
    seconds: float


def _chunk_elems(dtype: np.dtype, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // dtype.itemsize)


# -- the donor -------------------------------------------------------------------------------------
def send_state(pod_index: int, transfer_id: str, to_pod: int, to_address: str, leaves: list[np.ndarray],
               step: int, fingerprint: str, secret: str, deadline: float, *, chunk_bytes: int = 2 << 20,
               streams: int = 1) -> TransferStats:
    """Stream `leaves` (the state at `step`, whose hash is `fingerprint`) to pod `to_pod`'s
    listener at `to_address`, and return once the receiver confirmed it holds all of it.
    TransferError if the connection fails or is refused, the receiver refuses a chunk, or the
    deadline (time.monotonic) passes first."""
    if streams < 1 or chunk_bytes <= 0:
        raise ValueError("streams and chunk_bytes must be positive")
    mark = fingerprint.encode("ascii")
    if len(mark) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"a fingerprint of {len(mark)} bytes (at most {MAX_FINGERPRINT_BYTES})")
    flat = [np.ascontiguousarray(leaf).reshape(-1) for leaf in leaves]
    total = sum(values.nbytes for values in flat)
    where = f"state transfer {transfer_id} to pod {to_pod} at {to_address}"
    start = time.perf_counter()
    context = zmq.Context(1)
    connections: list[Connection] = []
    sent = 0
    try:
        for _ in range(streams):
            connections.append(Connection(context, to_address, pod_index, to_pod, transfer_id, secret))
            connections[-1].handshake(deadline)
        manifest = HEADER.pack(protos.PROTOCOL_VERSION, pod_index, step, PHASE_STATE_MANIFEST, len(flat), total)
        complete = _send_manifest(connections[0], manifest, mark, deadline)
        turn = 0
        for i, values in enumerate(flat):
            per, item = _chunk_elems(values.dtype, chunk_bytes), values.dtype.itemsize
            raw = values.view(np.uint8)
            for a in range(0, values.size, per):
                b = min(a + per, values.size)
                header = HEADER.pack(protos.PROTOCOL_VERSION, pod_index, step, PHASE_STATE, i, a)
                connections[turn % streams].send(header, raw[a * item:b * item], deadline)
                turn += 1
                sent += (b - a) * item
                if turn % 64 == 0:      # a receiver that gave up says so: stop early, with its reason
                    complete = _acknowledged(receive_any(connections, 0.0, deadline), to_pod) or complete
        while not complete:
            complete = _acknowledged(receive_any(connections, deadline, deadline,
                                                 "waiting for the confirmation of"), to_pod)
    except LinkError as exc:
        raise TransferError(f"{where}: {exc} ({sent} of {total} bytes sent)") from None
    except TransferError as exc:
        raise TransferError(f"{where}: {exc} ({sent} of {total} bytes sent)") from None
    finally:
        for connection in connections:
            connection.close()
        context.destroy(linger=0)
    return TransferStats(bytes=sent, seconds=time.perf_counter() - start)


def _send_manifest(connection: Connection, header: bytes, mark: bytes, deadline: float) -> bool:
    """Send the manifest until acknowledged; True if that already completes the transfer."""
    pause = 0.05
    while True:
        connection.send(header, mark, deadline)
        try:
            got = receive_any([connection], min(deadline, time.monotonic() + pause), deadline)
        except LinkError as exc:
            if time.monotonic() < deadline:
                raise
            raise TransferError(f"pod {connection.peer} never acknowledged the manifest (is it waiting for "
                                f"this transfer?): {exc}") from None
        if got is not None:
            return _acknowledged(got, connection.peer)
        pause = min(2 * pause, 1.0)


def _acknowledged(got, peer: int) -> bool:
    """A reply of the receiver: True if it holds the whole state; TransferError if it refused."""
    if got is None:
        return False
    frames = got[1]
    if frames[0] == REFUSED:
        why = frames[1].decode(errors="replace") if len(frames) > 1 else "no reason given"
        raise TransferError(f"pod {peer} refused it: {why}")
    return frames[0] == ACK and len(frames) > 1 and frames[1] == _COMPLETE_ACK


# -- the receiver ----------------------------------------------------------------------------------
class StateReceiver:
    """The receiving side of one transfer: a Listener sink (attach it, then wait()). Validates
    every chunk (from the donor only; the manifest first; one step; the leaf, offset and size on
    the grid; no duplicates) into staging buffers; a refused chunk writes nothing. Thread-safe."""

    replies = True      # the listener answers refused chunks: the donor stops at once

    def __init__(self, transfer_id: str, pod_index: int, from_pod: int, specs: list[LeafSpec],
                 chunk_bytes: int = 2 << 20):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.run_id = transfer_id
        self.pod_index, self.from_pod, self.specs = pod_index, from_pod, list(specs)
        self.chunk_elems = [_chunk_elems(spec.dtype, chunk_bytes) for spec in self.specs]
        self.total_bytes = sum(spec.nbytes for spec in self.specs)
        self._staging = [np.empty(spec.size, spec.dtype) for spec in self.specs]
        self._seen: list[set[int]] = [set() for _ in self.specs]
        self._missing = sum(-(-spec.size // per) for spec, per in zip(self.specs, self.chunk_elems))
        self._manifest: tuple[int, str] | None = None       # (step, fingerprint)
        self._bytes = 0
        self._error = ""        # why the transfer failed; then every chunk is refused
        self._refusal = ""      # the last chunk refused, for the error at the deadline
        self._cond = threading.Condition()

    @property
    def complete(self) -> bool:
        return self._manifest is not None and self._missing == 0

    # -- from the listener ----------------------------------------------------------------------
    def receive(self, pod: int, step: int, phase: int, leaf: int, offset: int, payload) -> bytes | None:
        """One frame of the donor; returns the reply to send it (an acknowledgement) or None.
        InvalidChunk if it does not fit (nothing is written)."""
        with self._cond:
            if pod != self.from_pod:
                raise InvalidChunk(f"pod {pod} is not the donor of transfer {self.run_id} (pod {self.from_pod})")
            if self._error:
                raise InvalidChunk(f"transfer {self.run_id} already failed: {self._error}")
            if phase == PHASE_STATE_MANIFEST:
                return self._on_manifest(step, leaf, offset, payload)
            if phase != PHASE_STATE:
                raise InvalidChunk(f"phase {phase} is not part of a state transfer")
            if self._manifest is None:
                raise InvalidChunk("a state chunk before the manifest")
            if step != self._manifest[0]:
                raise InvalidChunk(f"a chunk of step {step}, the manifest's state is of step {self._manifest[0]}")
            if not 0 <= leaf < len(self.specs):
                raise InvalidChunk(f"leaf {leaf} out of range (the state has {len(self.specs)} leaves)")
            spec, per = self.specs[leaf], self.chunk_elems[leaf]
            if not 0 <= offset < spec.size or offset % per:
                raise InvalidChunk(f"leaf {leaf}: offset {offset} is not on the grid of {per} values per chunk "
                                   f"over [0, {spec.size}) (dcn.chunk_bytes must be the same on both pods)")
            count = min(per, spec.size - offset)
            if len(payload) != count * spec.dtype.itemsize:
                raise InvalidChunk(f"leaf {leaf}: a chunk of {len(payload)} bytes at offset {offset}, expected "
                                   f"{count * spec.dtype.itemsize}")
            if offset // per in self._seen[leaf]:
                raise InvalidChunk(f"leaf {leaf}: duplicate chunk at offset {offset}")
            self._seen[leaf].add(offset // per)
        # Copy outside the lock: the chunk's place is reserved for it alone.
        self._staging[leaf][offset:offset + count] = np.frombuffer(payload, spec.dtype, count=count)
        with self._cond:
            self._bytes += len(payload)
            self._missing -= 1
            if self.complete:
                self._cond.notify_all()
                return _COMPLETE_ACK
        return None

    def _on_manifest(self, step: int, leaves: int, nbytes: int, payload) -> bytes:
        if leaves != len(self.specs) or nbytes != self.total_bytes:
            raise InvalidChunk(f"the donor's state has {leaves} leaves of {nbytes} bytes, this pod's "
                               f"{len(self.specs)} leaves of {self.total_bytes} bytes (not the same model and "
                               f"optimizer)")
        if len(payload) > MAX_FINGERPRINT_BYTES:
            raise InvalidChunk(f"a manifest of {len(payload)} bytes")
        try:
            fingerprint = bytes(payload).decode("ascii")
        except UnicodeDecodeError:
            raise InvalidChunk("a manifest whose fingerprint is not ASCII") from None
        if self._manifest is not None and self._manifest != (step, fingerprint):
            raise InvalidChunk(f"a second manifest (step {step}) unlike the first (step {self._manifest[0]})")
        self._manifest = (step, fingerprint)     # a repeat is acknowledged again
        self._cond.notify_all()
        return _COMPLETE_ACK if self.complete else _MANIFEST_ACK

    def refused_chunk(self, pod: int, why: str) -> None:
        with self._cond:
            self._refusal = why

    def lost(self, pod: int, steps: set[int], why: str) -> None:
        """A connection of this transfer closed: if the donor's, the rest cannot arrive now."""
        with self._cond:
            if pod == self.from_pod and not self.complete and not self._error:
                self._error = f"{why} after {self._bytes} of {self.total_bytes} bytes arrived"
                self._cond.notify_all()

    # -- from the pod ------------------------------------------------------------------------------
    def wait(self, deadline: float) -> tuple[int, str, list[np.ndarray], int]:
        """Block until the whole state has arrived: (step, the donor's fingerprint, the leaves
        shaped as `specs`, bytes received). The caller must check the fingerprint before using
        them. TransferError at the deadline (time.monotonic) or as soon as the donor's
        connection is lost mid-stream; then nothing is handed out, and later chunks are refused."""
        with self._cond:
            while True:
                if self._error:
                    raise TransferError(f"state transfer {self.run_id} from pod {self.from_pod} failed: "
                                        f"{self._error}{self._last_refusal()}")
                if self.complete:
                    assert self._manifest is not None     # complete: the manifest came
                    step, fingerprint = self._manifest
                    leaves = [buf.reshape(spec.shape) for buf, spec in zip(self._staging, self.specs)]
                    return step, fingerprint, leaves, self._bytes
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._error = (f"{self._bytes} of {self.total_bytes} bytes arrived within the deadline ("
                                   f"{'manifest received' if self._manifest else 'no manifest'})")
                    raise TransferError(f"state transfer {self.run_id} from pod {self.from_pod} failed: "
                                        f"{self._error}{self._last_refusal()}")
                self._cond.wait(remaining)

    def _last_refusal(self) -> str:
        return f"; the last refused chunk: {self._refusal}" if self._refusal else ""
