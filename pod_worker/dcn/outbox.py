"""The outbox: this pod's streams to its peers, and the pacer of the slow-link mode.

Each peer gets `streams` links. A link is a thread that owns one Connection (a DEALER socket,
transport.py): it connects and proves the secret the first time it has something to send, then
sends the chunks queued for it, in order, each after the pacer lets it through. The step thread
only queues (put): encoding, copying and summing overlap with sending. While `packing` is set
(the exchange's LosslessPolicy), the links zstd-pack what the step queues before sending it
(packing.py). A link that fails reports the step and the peer (on_error), drops the rest of that
step's chunks, and reconnects for the next.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time

import numpy as np
import zmq

from multipod import protos
from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.packing import Packer
from multipod.pod_worker.dcn.transport import DATA, HEADER, PACKED

log = logging.getLogger(__name__)


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

    def wait(self, nbytes: int, queued_at: float, stop: threading.Event | None = None,
             deadline: float = math.inf) -> None:
        """Sleep until a chunk of `nbytes` queued at `queued_at` would have crossed the link, or
        until `stop` is set or `deadline` (time.monotonic) passes, whichever comes first."""
        now = time.monotonic()
        ready = queued_at + self.latency_s
        if self.bytes_per_s > 0:
            with self._lock:
                # The link serialises chunks: each starts when the previous one has left.
                begin = max(self._free_at, now - self.burst_bytes / self.bytes_per_s)
                self._free_at = begin + nbytes / self.bytes_per_s
                ready = max(ready, self._free_at)
        until = min(ready, deadline)
        if until > now:
            (stop or threading.Event()).wait(until - now)


class _Link(threading.Thread):
    """One stream to one peer."""

    def __init__(self, outbox: Outbox, peer: int, address: str, index: int):
        super().__init__(daemon=True, name=f"dcn-{outbox.pod_index}->{peer}.{index}")
        self.outbox, self.peer, self.address = outbox, peer, address
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._connection: Connection | None = None
        self._failed_step = -1
        self._packer: Packer | None = None

    def run(self) -> None:
        out = self.outbox
        while True:
            item = self.queue.get()
            if item is None:
                break
            step, deadline, header, payload, itemsize, queued_at = item
            if step == self._failed_step or out.stopped.is_set():
                continue
            try:
                if self._connection is None:
                    self._connection = Connection(out.context, self.address, out.pod_index, self.peer, out.run_id,
                                                  out.secret, out.stopped)
                    self._connection.handshake(deadline)
                kind, wire = DATA, payload
                if itemsize:      # queued while packing
                    self._packer = self._packer or Packer()
                    packed = self._packer.pack(payload, itemsize)
                    if packed is not None:
                        kind, wire = PACKED, packed
                        out.count_packed(payload.nbytes, len(packed))
                if out.pacer.active:
                    out.pacer.wait(len(wire), queued_at, out.stopped, deadline)
                self._connection.send(header, wire, deadline, kind)
            except Exception as exc:    # LinkError, ZMQError, or a bug: the step fails, the link lives on
                self._failed_step = step
                self._drop_connection()
                log.warning("step %d: sending to pod %d failed: %s", step, self.peer, exc)
                out.on_error(step, self.peer, f"sending to it failed: {exc}")
        self._drop_connection()

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class Outbox:
    """Queues chunks for the peers; `streams` links per peer drain them."""

    def __init__(self, pod_index: int, run_id: str, addresses: dict[int, str], streams: int, secret: str,
                 pacer: Pacer, on_error):
        self.pod_index, self.run_id, self.secret, self.pacer, self.on_error = pod_index, run_id, secret, pacer, on_error
        self.context = zmq.Context(1)
        self.stopped = threading.Event()
        self.packing = False        # set by the exchange's LosslessPolicy, read as each chunk is queued
        self._count_lock = threading.Lock()
        self.packed_bytes = (0, 0)  # (payload bytes, bytes on the wire) of every chunk sent packed so far
        self._links = {p: [_Link(self, p, a, k) for k in range(streams)] for p, a in addresses.items()}
        self._turn = {p: 0 for p in addresses}
        for links in self._links.values():
            for link in links:
                link.start()

    def put(self, step: int, deadline: float, peer: int, phase: int, leaf: int, offset: int,
            payload: np.ndarray) -> int:
        """Queue one chunk (round-robin over the peer's links); returns its wire bytes."""
        header = HEADER.pack(protos.PROTOCOL_VERSION, self.pod_index, step, phase, leaf, offset)
        links = self._links[peer]
        turn = self._turn[peer]
        self._turn[peer] = turn + 1
        data = payload.reshape(-1).view(np.uint8)     # plain bytes for zmq (bf16 has no buffer format)
        itemsize = payload.dtype.itemsize if self.packing else 0
        links[turn % len(links)].queue.put((step, deadline, header, data, itemsize, time.monotonic()))
        return data.nbytes

    def queued(self, peer: int) -> int:
        """Chunks queued for `peer` that its links have not taken yet."""
        return sum(link.queue.qsize() for link in self._links[peer])

    def count_packed(self, payload_bytes: int, wire_bytes: int) -> None:
        """A link sent a chunk packed (any thread)."""
        with self._count_lock:
            raw, wire = self.packed_bytes
            self.packed_bytes = (raw + payload_bytes, wire + wire_bytes)

    def close(self) -> None:
        """Stop every link (chunks still queued are dropped) and close the sockets."""
        self.stopped.set()
        for links in self._links.values():
            for link in links:
                link.queue.put(None)
        alive = []
        for links in self._links.values():
            for link in links:
                link.join(5.0)
                if link.is_alive():
                    alive.append(link.name)
        if alive:
            log.warning("data-plane links still busy at close: %s", ", ".join(alive))
        else:
            self.context.destroy(linger=0)
