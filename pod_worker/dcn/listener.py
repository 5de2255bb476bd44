"""The receiving end of the data plane: this worker's one ROUTER socket (Listener), which runs the
server's side of the handshake (transport.py) on every connection and hands proven peers' data
frames to a sink."""
from __future__ import annotations

import collections
import hmac
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from multipod import protos
from multipod.pod_worker.dcn.packing import unpack
from multipod.pod_worker.dcn.transport import (
    ACK,
    CHALLENGE,
    DATA,
    HEADER,
    HELLO,
    MAX_FRAME_BYTES,
    NONCE_BYTES,
    OK,
    PACKED,
    PODS,
    PROOF,
    REFUSED,
    close_monitored,
    curve_keys,
    format_address,
    handshake_proof,
    handshake_transcript,
    monitor_socket,
)

log = logging.getLogger(__name__)


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
        # close() writes a byte here to wake the thread's poll at once, instead of after its
        # timeout: a pod that closes its listener (each exchange's end, each worker's exit) would
        # otherwise wait up to the poll's 200 ms.
        self._wake_r, self._wake_w = os.pipe()
        self.context = zmq.Context(1)
        sock = self.socket = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 0)
        if curve:
            _, private = curve_keys(secret, b"server")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)
        self._monitor = monitor_socket(sock, zmq.EVENT_DISCONNECTED)
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
        if self._closed.is_set():
            return
        self._closed.set()
        os.write(self._wake_w, b"x")
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        close_monitored(self.socket, getattr(self, "_monitor", None))
        self.context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
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
        if len(frames) != 5 or len(frames[2].bytes) != PODS.size or len(frames[3].bytes) != NONCE_BYTES:
            return self._refuse_peer(ident, peer, "a malformed HELLO")
        version, client, server = PODS.unpack(frames[2].bytes)
        if version != protos.PROTOCOL_VERSION:
            return self._refuse_peer(ident, peer, f"a peer of protocol version {version} != {protos.PROTOCOL_VERSION}")
        if server != self.pod_index or client == self.pod_index:
            return self._refuse_peer(ident, peer, f"a HELLO from pod {client} to pod {server} reached pod "
                                                  f"{self.pod_index}")
        nonce_s = os.urandom(NONCE_BYTES)
        transcript = handshake_transcript(client, server, frames[3].bytes, nonce_s, frames[4].bytes)
        peer.challenge = (client, frames[4].bytes.decode("utf-8", "replace"), transcript)
        self._reply(ident, CHALLENGE, nonce_s, handshake_proof(self.secret, b"server", transcript))

    def _on_proof(self, ident: bytes, peer: _Peer, frames: list) -> None:
        if peer.challenge is None or len(frames) != 3:
            return self._refuse_peer(ident, peer, "a PROOF without a HELLO, or malformed")
        client, run_id, transcript = peer.challenge
        if not hmac.compare_digest(frames[2].bytes, handshake_proof(self.secret, b"client", transcript)):
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


