"""The data-plane listener when connections close and new ones open at once (a hot swap: the dead
pod's links close as the spare's open). The kernel gives a new connection the lowest free file
descriptor, usually one a closed connection just freed; the listener must not take the closed
connection's disconnection for the new one's (which forgot the new peer halfway through its
handshake, so it was refused: "a PROOF without a HELLO")."""
from __future__ import annotations

import time

import zmq

from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.listener import Listener
from tests.unit.pod_worker.test_dcn import RUN, SECRET

LINKS = 16      # many events at once, as when a pod's streams close together
ROUNDS = 10


def _handshaken(context: zmq.Context, address: str, links: list[Connection]) -> None:
    """LINKS new links in `links` (kept there for the clean-up if one fails), each handshaken."""
    for _ in range(LINKS):
        links.append(Connection(context, address, 1, 0, RUN, SECRET))
    for link in links:
        link.handshake(time.monotonic() + 10)


def test_links_that_replace_closed_ones_on_their_descriptors_all_complete_their_handshake():
    listener = Listener(0, "127.0.0.1:0", SECRET)
    # One context, as an Outbox's links reconnect in theirs: each new link's socket may take a
    # closed one's descriptor, after which pyzmq's default monitor address would be a name in use.
    context = zmq.Context()
    links: list[Connection] = []
    try:
        _handshaken(context, listener.address, links)
        for _ in range(ROUNDS):
            for link in links:
                link.close()
            links = []
            _handshaken(context, listener.address, links)     # raises LinkError if refused
        assert listener.refused == 0, list(listener.refusals)
    finally:
        for link in links:
            link.close()
        listener.close()
        context.term()

