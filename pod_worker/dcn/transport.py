"""The data-plane transport's protocol: the connection handshake, the frames, addresses and CURVE
keys, and the ZeroMQ socket monitors both ends use.

Every worker binds one ROUTER socket at start (listener.py, Listener); every stream this pod sends
on is a DEALER socket connected to a peer's listener (connection.py, Connection). gRPC stays the
control plane.

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

import hashlib
import hmac
import itertools
import struct
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils import z85

from multipod import protos
from multipod.pod_worker.dcn.wire import BLOCK

HELLO, CHALLENGE, PROOF, OK, REFUSED, DATA, ACK, PACKED = b"H", b"C", b"P", b"K", b"R", b"D", b"A", b"Z"
HEADER = struct.Struct("<HHQBIQ")        # version, pod, step, phase, leaf, offset (values)
PODS = struct.Struct("<HHH")             # version, client pod, server pod
NONCE_BYTES = 32
MAX_FRAME_BYTES = protos.MAX_CHUNK_BYTES + protos.MAX_CHUNK_BYTES // BLOCK * 4 + 4096
PLAIN, CURVE = "tcp://", "curve://"


class LinkError(RuntimeError):
    """A connection to a peer could not be set up or broke."""


_MONITORS = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket that receives `sock`'s `events`. Its in-process address is unique for the
    process: pyzmq's default names it after the socket's file descriptor, which a new socket can
    take while the closed one's name is still registered ("Address already in use")."""
    return sock.get_monitor_socket(events, addr=f"inproc://multipod-monitor-{next(_MONITORS)}")


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Stop monitoring a socket, close it, then close its monitor: with libzmq 4.3.5, closing the
    monitor first kept the pair's three file descriptors for as long as the context lived, seen
    with a socket closed before it had connected."""
    if monitor is not None and not sock.closed:
        sock.disable_monitor()
    sock.close(linger=0)
    if monitor is not None:
        monitor.close(linger=0)


def event_name(event: Mapping[str, Any]) -> str:
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


def handshake_proof(secret: str, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret.encode(), b"multipod-dcn/" + role + transcript, hashlib.sha256).digest()


def handshake_transcript(client: int, server: int, nonce_c: bytes, nonce_s: bytes, run_id: bytes) -> bytes:
    return PODS.pack(protos.PROTOCOL_VERSION, client, server) + nonce_c + nonce_s + run_id
