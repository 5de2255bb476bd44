"""What CURVE costs on this host: the data plane's own Listener and Connection over loopback TCP,
timed with encryption and without (ProbeLink with measure_encryption, for `multipod tune --dcn`).

The tuner cannot probe the pods' link unencrypted: beyond loopback a worker refuses to listen
without CURVE unless --insecure. What it can measure apart is the hosts' side of the cost: the rate
the data plane moves frames at when no wire limits it. One Connection (the handshake, frames and
socket options of a run, in its own one-I/O-thread context as an Outbox's) sends `chunk_bytes`
frames to a Listener on 127.0.0.1 of this host, whose sink copies each payload once, as the Inbox
does. Both I/O threads run on this host, as in an exchange, where a host encrypts what it sends
while it decrypts what it receives. All of an Outbox's streams share its one I/O thread, and all
connections to a Listener share that one's, so the CURVE rate bounds every stream together, not
each stream.

The clock starts at the first frame the sink takes (the connection is set up by then) and stops
at the first frame `seconds` later; the rate is the bytes in between over that time.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from multipod import protos
from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.listener import Listener
from multipod.pod_worker.dcn.transport import HEADER, LinkError

RUN_ID = "curve-rate"
SETUP_S = 5.0           # the handshake, at most (it takes milliseconds on loopback)
SLACK_S = 2.0           # past `seconds`: a host this slow has no rate worth reporting


class RateError(RuntimeError):
    """The loopback pair could not be set up, or did not move frames in time."""


@dataclass(frozen=True)
class HostRates:
    """Bytes per second the data plane moves on this host, CURVE-encrypted and plain."""
    curve_bytes_per_s: float
    plain_bytes_per_s: float


class _TimingSink:
    """A Listener sink that copies each payload into one buffer and times them (module docstring)."""

    run_id = RUN_ID

    def __init__(self, chunk_bytes: int, seconds: float):
        self.buffer = np.empty(chunk_bytes, np.uint8)
        self.seconds = seconds
        self.first: float | None = None
        self.last = 0.0
        self.bytes = 0                  # after the first frame
        self.done = threading.Event()

    def receive(self, pod, step, phase, leaf, offset, payload) -> None:
        data = np.frombuffer(payload, np.uint8)[:self.buffer.size]
        self.buffer[:data.size] = data
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif not self.done.is_set():
            self.bytes += data.size
            self.last = now
            if now - self.first >= self.seconds:
                self.done.set()

    def refused_chunk(self, pod, why) -> None:
        pass

    def lost(self, pod, steps, why) -> None:
        pass


def rate(chunk_bytes: int, curve: bool, seconds: float, deadline: float) -> float:
    """Bytes per second one stream of the data plane moves over loopback on this host, for about
    `seconds`; RateError if it cannot be set up or moves too little before `deadline` (monotonic)."""
    secret = secrets.token_hex(16)      # throwaway: the CURVE keys are derived from it as in a run
    sink = _TimingSink(chunk_bytes, seconds)
    listener = Listener(0, "127.0.0.1:0", secret, curve=curve)
    context = zmq.Context(1)
    connection = None
    try:
        listener.attach(sink)
        connection = Connection(context, listener.address, 1, 0, RUN_ID, secret)
        connection.handshake(min(deadline, time.monotonic() + SETUP_S))
        header = HEADER.pack(protos.PROTOCOL_VERSION, 1, 0, 0, 0, 0)
        payload = np.ones(chunk_bytes, np.uint8)
        end = min(deadline, time.monotonic() + seconds + SLACK_S)
        while not sink.done.is_set():
            if time.monotonic() >= end:
                raise RateError(f"the {'CURVE' if curve else 'plain'} loopback pair moved "
                                f"{sink.bytes} bytes in {seconds + SLACK_S:.1f} s")
            connection.send(header, payload, end)
    except LinkError as exc:
        raise RateError(f"the {'CURVE' if curve else 'plain'} loopback pair: {exc}") from None
    finally:
        # The listener first: frames still queued after the connection closes would reach it as
        # frames of a connection that never proved the secret, each logged as refused.
        listener.close()
        if connection is not None:
            connection.close()
        context.destroy(linger=0)
    assert sink.first is not None
    return sink.bytes / (sink.last - sink.first)


def measure(chunk_bytes: int, seconds: float, deadline: float) -> HostRates:
    """This host's CURVE and plain rates, one after the other (never at once: they would share
    the cores), `seconds` each."""
    return HostRates(rate(chunk_bytes, True, seconds, deadline), rate(chunk_bytes, False, seconds, deadline))
