"""The sending end of the data plane: one stream to a peer's listener (Connection), which runs the
client's side of the handshake (transport.py), and `receive_any`, the listener's replies on a
peer's streams."""
from __future__ import annotations

import hmac
import os
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from multipod import protos
from multipod.pod_worker.dcn.transport import (
    CHALLENGE,
    DATA,
    HELLO,
    NONCE_BYTES,
    OK,
    PODS,
    PROOF,
    REFUSED,
    LinkError,
    close_monitored,
    curve_keys,
    event_name,
    handshake_proof,
    handshake_transcript,
    monitor_socket,
    parse_address,
)


class Connection:
    """One stream from this pod to a peer's listener (use from one thread only)."""

    _BROKEN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED

    def __init__(self, context: zmq.Context, address: str, pod: int, peer: int, run_id: str, secret: str,
                 stop: threading.Event | None = None):
        endpoint, curve = parse_address(address)
        self.address, self.pod, self.peer, self.run_id, self.secret = address, pod, peer, run_id, secret
        self.stop = stop or threading.Event()     # set: every wait ends at once (the exchange closes)
        sock = self.socket = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)           # queue only on a live connection
        sock.setsockopt(zmq.RECONNECT_IVL, -1)      # a broken connection stays broken: a new one re-proves
        sock.setsockopt(zmq.MAXMSGSIZE, 4096)       # the listener only sends handshake replies
        sock.setsockopt(zmq.SNDHWM, 64)
        if curve:
            public, private = curve_keys(secret, b"client")
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve_keys(secret, b"server")[0])
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)
        try:
            self._monitor = monitor_socket(sock, self._BROKEN)
            self._poller = zmq.Poller()
            self._poller.register(self._monitor, zmq.POLLIN)
            sock.connect(endpoint)
        except zmq.ZMQError:
            # An unclosed socket would make the context's term() wait for it forever.
            close_monitored(sock, getattr(self, "_monitor", None))
            raise

    def close(self) -> None:
        close_monitored(self.socket, self._monitor)

    def _wait(self, flag: int, deadline: float, doing: str) -> None:
        self._poller.register(self.socket, flag)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LinkError(f"{doing} pod {self.peer} at {self.address} timed out")
                if self.stop.is_set():
                    raise LinkError(f"{doing} pod {self.peer}: the exchange was closed")
                ready = dict(self._poller.poll(int(min(remaining, 0.2) * 1000)))
                if self._monitor in ready:
                    event = parse_monitor_message(self._monitor.recv_multipart())
                    raise LinkError(f"{doing} pod {self.peer} at {self.address}: connection "
                                    f"{event_name(event)}")
                if ready.get(self.socket, 0) & flag:
                    return
        finally:
            self._poller.unregister(self.socket)

    def handshake(self, deadline: float) -> None:
        nonce_c = os.urandom(NONCE_BYTES)
        run = self.run_id.encode()
        self._wait(zmq.POLLOUT, deadline, "connecting to")
        self.socket.send_multipart([HELLO, PODS.pack(protos.PROTOCOL_VERSION, self.pod, self.peer), nonce_c, run])
        self._wait(zmq.POLLIN, deadline, "the handshake with")
        reply = self.socket.recv_multipart()
        if reply[0] == REFUSED:
            raise LinkError(f"pod {self.peer} at {self.address} refused the connection: "
                            f"{reply[1].decode(errors='replace') if len(reply) > 1 else ''}")
        if reply[0] != CHALLENGE or len(reply) != 3 or len(reply[1]) != NONCE_BYTES:
            raise LinkError(f"pod {self.peer} at {self.address} answered the handshake with a malformed reply")
        transcript = handshake_transcript(self.pod, self.peer, nonce_c, reply[1], run)
        if not hmac.compare_digest(reply[2], handshake_proof(self.secret, b"server", transcript)):
            raise LinkError(f"the data plane at {self.address} did not prove the run's secret: it is not pod "
                            f"{self.peer} of this run")
        self.socket.send_multipart([PROOF, handshake_proof(self.secret, b"client", transcript)])
        self._wait(zmq.POLLIN, deadline, "the handshake with")
        reply = self.socket.recv_multipart()
        if reply[0] != OK:
            raise LinkError(f"pod {self.peer} at {self.address} refused the connection: "
                            f"{reply[1].decode(errors='replace') if len(reply) > 1 else 'no reason given'}")

    def send(self, header: bytes, payload, deadline: float, kind: bytes = DATA) -> None:
        """One data frame (DATA, or PACKED with a packed payload); the payload (any buffer) goes
        out without a copy."""
        self._wait(zmq.POLLOUT, deadline, "sending to")
        self.socket.send(kind, zmq.SNDMORE)
        self.socket.send(header, zmq.SNDMORE)
        self.socket.send(payload, copy=False)


def receive_any(connections: list[Connection], until: float, deadline: float,
                doing: str = "waiting for a reply from") -> tuple[Connection, list[bytes]] | None:
    """The next reply (ACK or REFUSED frames) the listener sends on any of `connections` (to one
    peer, after their handshakes), or None once `until` passes (polled at least once). LinkError
    at the deadline, if a connection breaks, or on stop."""
    poller = zmq.Poller()
    for c in connections:
        poller.register(c.socket, zmq.POLLIN)
        poller.register(c._monitor, zmq.POLLIN)
    peer = connections[0]
    while True:
        if any(c.stop.is_set() for c in connections):
            raise LinkError(f"{doing} pod {peer.peer}: stopped")
        now = time.monotonic()
        ready = dict(poller.poll(int(max(0.0, min(until - now, deadline - now, 0.2)) * 1000)))
        for c in connections:
            if c._monitor in ready:
                event = parse_monitor_message(c._monitor.recv_multipart())
                raise LinkError(f"{doing} pod {c.peer} at {c.address}: connection "
                                f"{event_name(event)}")
            if c.socket in ready:
                return c, c.socket.recv_multipart()
        now = time.monotonic()
        if now >= deadline:
            raise LinkError(f"{doing} pod {peer.peer} at {peer.address} timed out")
        if now >= until:
            return None
