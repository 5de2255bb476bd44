"""The data-plane transport: ZeroMQ sockets, the connection handshake, and the frames.

Every worker binds one ROUTER socket at start (Listener); every stream this pod sends on is a
DEALER socket connected to a peer's listener (Connection). gRPC stays the control plane.

Handshake, on every connection before any gradient byte:
    client -> server   HELLO      version, client pod, server pod, client nonce, run id
    server -> client   CHALLENGE  server nonce, HMAC(secret, "server" + transcript)
    client -> server   PROOF      HMAC(secret, "client" + transcript)
    server -> client   OK | REFUSED reason
The transcript holds the version, both pod indices, both nonces and the run id. Neither side sends
the secret (the run's auth token): each proves it holds it. The server then binds the connection
to the client's pod index and run id; a data frame claiming any other pod is refused.

Data frame: DATA, a fixed header (HEADER: version, pod, step, phase, leaf, offset in values), and
the payload. A PACKED frame is the same with the payload zstd-packed (packing.py, dcn.lossless):
the listener unpacks it, checking its claimed size against MAX_FRAME_BYTES first, and hands the
sink the payload as if it had come raw.
The sender passes zmq a view of its buffer (copy=False: libzmq writes it to the socket from
there); the receiver gets libzmq's frame, validates the header, and only then copies or decodes
the frame's buffer into its preallocated destination: one user-space copy on each side.
Frames over MAX_FRAME_BYTES are refused by libzmq itself (ZMQ_MAXMSGSIZE: the peer is dropped).

Replies to data frames: none for the gradient exchange (a peer that misses bytes fails its own
step). A sink may answer a frame it took (its receive returns bytes: ACK + them, on the same
connection), and, if it sets `replies`, a frame it refused (REFUSED + why): the state transfer
(transfer.py) uses both to learn that the receiver holds everything, or why it will not.

Encryption: an address "curve://HOST:PORT" is a CURVE listener; its keys are derived from the
secret, so only holders of the secret can even complete the transport's own handshake.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from multipod import protos
from multipod.pod_worker.dcn.packing import unpack
from multipod.pod_worker.dcn.wire import BLOCK

log = logging.getLogger(__name__)

HELLO, CHALLENGE, PROOF, OK, REFUSED, DATA, ACK, PACKED = b"H", b"C", b"P", b"K", b"R", b"D", b"A", b"Z"
HEADER = struct.Struct("<HHQBIQ")        # version, pod, step, phase, leaf, offset (values)
_PODS = struct.Struct("<HHH")            # version, client pod, server pod
NONCE_BYTES = 32
MAX_FRAME_BYTES = protos.MAX_CHUNK_BYTES + protos.MAX_CHUNK_BYTES // BLOCK * 4 + 4096
PLAIN, CURVE = "tcp://", "curve://"


class LinkError(RuntimeError):
    """A connection to a peer could not be set up or broke."""


_MONITORS = itertools.count()


def _monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket that receives `sock`'s `events`. Its in-process address is unique for the
    process: pyzmq's default names it after the socket's file descriptor, which a new socket can
    take while the closed one's name is still registered ("Address already in use")."""
    return sock.get_monitor_socket(events, addr=f"inproc://multipod-monitor-{next(_MONITORS)}")


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Stop monitoring a socket, close it, then close its monitor: with libzmq 4.3.5, closing the
    monitor first kept the pair's three file descriptors for as long as the context lived, seen
    with a socket closed before it had connected."""
    if monitor is not None and not sock.closed:
        sock.disable_monitor()
    sock.close(linger=0)
    if monitor is not None:
        monitor.close(linger=0)


def _event_name(event: Mapping[str, Any]) -> str:
    """A socket monitor event's name, e.g. "disconnected" (its number if zmq has no name for it)."""
    name = zmq.Event(event["event"]).name
    return name.lower() if name else f"event {event['event']}"


# -- addresses and keys -----------------------------------------------------------------------------
def format_address(host: str, port: int, curve: bool) -> str:
    return f"{CURVE if curve else PLAIN}{host}:{port}"


def parse_address(address: str) -> tuple[str, bool]:
    """A data-plane address -> (zmq endpoint, CURVE?). ValueError if it is not one."""
    for scheme, curve in ((PLAIN, False), (CURVE, True)):
        if address.startswith(scheme):
            host, _, port = address[len(scheme):].rpartition(":")
            if host and port.isdigit():
                return f"tcp://{host}:{port}", curve
    raise ValueError(f"not a data-plane address (tcp://HOST:PORT or curve://HOST:PORT): {address!r}")


def curve_keys(secret: str, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys of `role` (b"server" or b"client"), derived from the secret."""
    if not secret:
        raise ValueError("data-plane encryption needs the run's auth token (its keys are derived from it)")
    private = z85.encode(hmac.new(secret.encode(), b"multipod-dcn-curve/" + role, hashlib.sha256).digest())
    return zmq.curve_public(private), private


def _proof(secret: str, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret.encode(), b"multipod-dcn/" + role + transcript, hashlib.sha256).digest()


def _transcript(client: int, server: int, nonce_c: bytes, nonce_s: bytes, run_id: bytes) -> bytes:
    return _PODS.pack(protos.PROTOCOL_VERSION, client, server) + nonce_c + nonce_s + run_id


# -- the receiving side -------------------------------------------------------------------------
class _Peer:
    """One connection to this pod's listener, as far as the handshake got."""

    def __init__(self, fd: int):
        self.fd = fd
        self.pod: int | None = None     # set once the peer proved the secret
        self.run_id = ""
        self.challenge: tuple | None = None
        self.refused = ""               # why, once refused: later frames are dropped quietly
        self.steps: set[int] = set()    # steps this connection delivered chunks to


class Listener:
    """This worker's data-plane socket: accepts peers that prove the secret and hands their data
    frames to the attached sink (the current exchange's Inbox, or a transfer's StateReceiver).
    One thread does it all; a bad frame is logged, counted and dropped, never fatal.

    A sink has: run_id (only connections of that run reach it); receive(pod, step, phase, leaf,
    offset, payload) -> None or reply bytes, raising ValueError to refuse; refused_chunk(pod,
    why); lost(pod, steps, why), when a connection of its run that proved `pod` closes; and
    optionally replies = True (refusals are answered to the sender)."""

    def __init__(self, pod_index: int | None, listen: str, secret: str = "", curve: bool = False):
        self.pod_index = pod_index      # None: a spare's, which accepts no peer until it has a slot
        self.secret = secret
        self.refused = 0                                   # frames and connections refused so far
        self.refusals: collections.deque[str] = collections.deque(maxlen=32)
        self._sink = None
        self._peers: dict[bytes, _Peer] = {}
        self._by_fd: dict[int, bytes] = {}
        # Routing ids of closed connections (ZeroMQ never reuses one): frames of theirs still queued
        # are dropped, not taken for a new connection's on a descriptor that is no longer theirs.
        self._gone: collections.deque[bytes] = collections.deque(maxlen=256)
        self._closed = threading.Event()
        self.context = zmq.Context(1)
        sock = self.socket = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 0)
        if curve:
            _, private = curve_keys(secret, b"server")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)
        self._monitor = _monitor(sock, zmq.EVENT_DISCONNECTED)
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dcn-listen must be HOST:PORT, got {listen!r}")
        try:
            if int(port) == 0:
                bound = sock.bind_to_random_port(f"tcp://{host}")
            else:
                sock.bind(f"tcp://{host}:{port}")
                bound = int(port)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot listen for the data plane on {listen}: {exc}") from None
        self.address = format_address(host, bound, curve)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dcn-listen-{pod_index}")
        self._thread.start()

    def attach(self, sink) -> None:
        """Hand data frames to `sink` from now on (see the class doc for what a sink has)."""
        if sink is not self._sink:
            for peer in self._peers.values():
                peer.steps.clear()
        self._sink = sink

    def detach(self, sink) -> None:
        if self._sink is sink:
            self._sink = None

    def close(self) -> None:
        self._closed.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        _close_monitored(self.socket, getattr(self, "_monitor", None))
        self.context.term()

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                ready = dict(poller.poll(200))
                if self._monitor in ready:
                    self._drain_events()
                for _ in range(256 if self.socket in ready else 0):
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
            except zmq.ZMQError as exc:
                if self._closed.is_set():
                    return
                log.warning("data plane: %s", exc)
            except Exception:   # a bug: keep the listener alive, say so
                log.exception("data plane: unexpected error")

    def _refuse(self, peer: _Peer | None, why: str) -> None:
        self.refused += 1
        self.refusals.append(why)
        if peer is not None and peer.refused:
            return      # logged once per connection
        log.warning("data plane of pod %s refused: %s", self.pod_index, why)
        sink = self._sink
        # Only a refusal within the sink's own run says something about what it waits for.
        if sink is not None and peer is not None and peer.pod is not None and peer.run_id == sink.run_id:
            sink.refused_chunk(peer.pod, why)

    def _drain_events(self) -> None:
        """Handle every connection event queued so far. All of them, not one: the kernel hands a
        new connection the lowest free descriptor, often one a closed connection just freed, and
        ZeroMQ queues a connection's events before its first frame. A disconnection still queued
        when a new connection's first frame is read would otherwise be taken for the new one's and
        forget it, and its handshake would be refused halfway (seen in a hot swap under --netns)."""
        while True:
            try:
                message = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_event(parse_monitor_message(message))

    def _on_event(self, event: Mapping[str, Any]) -> None:
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        ident = self._by_fd.pop(int(event["value"]), None)
        peer = self._peers.pop(ident, None) if ident is not None else None
        if ident is not None:
            self._gone.append(ident)
        sink = self._sink
        if peer is not None and peer.pod is not None and sink is not None and peer.run_id == sink.run_id:
            sink.lost(peer.pod, peer.steps, "its data-plane connection closed")
            # A link that carried data, and the pod's last one in this run: the pod is gone.
            others = any(p.pod == peer.pod and p.run_id == peer.run_id for p in self._peers.values())
            if peer.steps and not others and hasattr(sink, "gone"):
                sink.gone(peer.pod, "every data-plane connection of it closed")

    def _on_frames(self, frames: list) -> None:
        ident, kind = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
        peer = self._peers.get(ident)
        if peer is None:
            self._drain_events()        # a closed connection's events first: it may have had this fd
            if ident in self._gone:     # the last frames of a connection that has closed
                return
            fd = frames[-1].get(zmq.SRCFD)
            peer = self._peers[ident] = _Peer(fd)
            self._by_fd[fd] = ident
        if peer.refused:
            self._refuse(peer, peer.refused)
            return
        if kind in (DATA, PACKED):
            self._on_data(ident, peer, frames, packed=kind == PACKED)
        elif kind == HELLO:
            self._on_hello(ident, peer, frames)
        elif kind == PROOF:
            self._on_proof(ident, peer, frames)
        else:
            self._refuse(peer, f"a frame of unknown kind {kind[:8]!r} ({len(frames)} parts)")

    def _reply(self, ident: bytes, *parts: bytes) -> None:
        try:
            self.socket.send_multipart([ident, *parts], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass    # the peer went away; it times out on its side

    def _refuse_peer(self, ident: bytes, peer: _Peer, why: str) -> None:
        self._refuse(peer, why)
        peer.refused = why
        self._reply(ident, REFUSED, why.encode())

    def _on_hello(self, ident: bytes, peer: _Peer, frames: list) -> None:
        if len(frames) != 5 or len(frames[2].bytes) != _PODS.size or len(frames[3].bytes) != NONCE_BYTES:
            return self._refuse_peer(ident, peer, "a malformed HELLO")
        version, client, server = _PODS.unpack(frames[2].bytes)
        if version != protos.PROTOCOL_VERSION:
            return self._refuse_peer(ident, peer, f"a peer of protocol version {version} != {protos.PROTOCOL_VERSION}")
        if server != self.pod_index or client == self.pod_index:
            return self._refuse_peer(ident, peer, f"a HELLO from pod {client} to pod {server} reached pod "
                                                  f"{self.pod_index}")
        nonce_s = os.urandom(NONCE_BYTES)
        transcript = _transcript(client, server, frames[3].bytes, nonce_s, frames[4].bytes)
        peer.challenge = (client, frames[4].bytes.decode("utf-8", "replace"), transcript)
        self._reply(ident, CHALLENGE, nonce_s, _proof(self.secret, b"server", transcript))

    def _on_proof(self, ident: bytes, peer: _Peer, frames: list) -> None:
        if peer.challenge is None or len(frames) != 3:
            return self._refuse_peer(ident, peer, "a PROOF without a HELLO, or malformed")
        client, run_id, transcript = peer.challenge
        if not hmac.compare_digest(frames[2].bytes, _proof(self.secret, b"client", transcript)):
            return self._refuse_peer(ident, peer, f"a connection claiming pod {client} did not prove the run's "
                                                  f"secret (wrong or missing auth token)")
        peer.pod, peer.run_id, peer.challenge = client, run_id, None
        self._reply(ident, OK)

    def _on_data(self, ident: bytes, peer: _Peer, frames: list, packed: bool = False) -> None:
        if peer.pod is None:
            return self._refuse(peer, "a data frame on a connection that has not proved the secret")
        if len(frames) != 4 or len(frames[2].bytes) != HEADER.size:
            return self._refuse(peer, f"a malformed data frame from pod {peer.pod} ({len(frames)} parts)")
        version, pod, step, phase, leaf, offset = HEADER.unpack(frames[2].bytes)
        if version != protos.PROTOCOL_VERSION:
            return self._refuse(peer, f"a chunk of protocol version {version} from pod {peer.pod}")
        if pod != peer.pod:
            return self._refuse(peer, f"a chunk claiming pod {pod} on a connection bound to pod {peer.pod}")
        sink = self._sink
        if sink is None or sink.run_id != peer.run_id:
            return self._refuse(peer, f"a chunk of run {peer.run_id!r} from pod {pod}, which is not this pod's "
                                      f"current run")
        try:
            payload = unpack(frames[3].buffer, MAX_FRAME_BYTES) if packed else frames[3].buffer
            reply = sink.receive(pod, step, phase, leaf, offset, payload)
        except ValueError as exc:      # InvalidChunk, PackingError
            self._refuse(peer, f"a chunk from pod {pod}: {exc}")
            if getattr(sink, "replies", False):
                self._reply(ident, REFUSED, str(exc).encode()[:1024])   # the DEALER takes <= 4096 bytes
            return
        if reply is not None:
            self._reply(ident, ACK, reply)
        peer.steps.add(step)
        if len(peer.steps) > 2:    # only the current and the next step can still be live
            peer.steps = set(sorted(peer.steps)[-2:])


# -- the sending side ------------------------------------------------------------------------------
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
            self._monitor = _monitor(sock, self._BROKEN)
            self._poller = zmq.Poller()
            self._poller.register(self._monitor, zmq.POLLIN)
            sock.connect(endpoint)
        except zmq.ZMQError:
            # An unclosed socket would make the context's term() wait for it forever.
            _close_monitored(sock, getattr(self, "_monitor", None))
            raise

    def close(self) -> None:
        _close_monitored(self.socket, self._monitor)

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
                                    f"{_event_name(event)}")
                if ready.get(self.socket, 0) & flag:
                    return
        finally:
            self._poller.unregister(self.socket)

    def handshake(self, deadline: float) -> None:
        nonce_c = os.urandom(NONCE_BYTES)
        run = self.run_id.encode()
        self._wait(zmq.POLLOUT, deadline, "connecting to")
        self.socket.send_multipart([HELLO, _PODS.pack(protos.PROTOCOL_VERSION, self.pod, self.peer), nonce_c, run])
        self._wait(zmq.POLLIN, deadline, "the handshake with")
        reply = self.socket.recv_multipart()
        if reply[0] == REFUSED:
            raise LinkError(f"pod {self.peer} at {self.address} refused the connection: "
                            f"{reply[1].decode(errors='replace') if len(reply) > 1 else ''}")
        if reply[0] != CHALLENGE or len(reply) != 3 or len(reply[1]) != NONCE_BYTES:
            raise LinkError(f"pod {self.peer} at {self.address} answered the handshake with a malformed reply")
        transcript = _transcript(self.pod, self.peer, nonce_c, reply[1], run)
        if not hmac.compare_digest(reply[2], _proof(self.secret, b"server", transcript)):
            raise LinkError(f"the data plane at {self.address} did not prove the run's secret: it is not pod "
                            f"{self.peer} of this run")
        self.socket.send_multipart([PROOF, _proof(self.secret, b"client", transcript)])
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
                                f"{_event_name(event)}")
            if c.socket in ready:
                return c, c.socket.recv_multipart()
        now = time.monotonic()
        if now >= deadline:
            raise LinkError(f"{doing} pod {peer.peer} at {peer.address} timed out")
        if now >= until:
            return None
