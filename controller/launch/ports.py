"""Ports a launcher picks for its workers before they start: free now, and not taken by anyone
else before the worker binds them.

A port the kernel hands out for a bind to port 0 is an ephemeral one, from the range it also
gives every outgoing connection its local port from. Chosen that way and released, such a port
can be taken by any process's next connection in the seconds before the worker binds it (seen
under Ray, whose hosts' ports are picked by a task before the actor starts: the data plane's
bind failed with "Address already in use" in every incarnation of the actor). Below that range
no port-0 bind and no outgoing connection lands, so only another server's explicit bind could
take one there."""
from __future__ import annotations

import contextlib
import pathlib
import random
import socket

# free_ports draws from this many ports just below the kernel's ephemeral range (above Ray's
# default worker ports, 10002-19999, with the kernel's default range).
PORTS_BELOW_EPHEMERAL = 8192


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different TCP ports on `host` ("" for every address of this machine) that nothing
    listens on right now, chosen at random below the kernel's ephemeral range (ephemeral_range):
    nothing else takes such a port between this choice and the worker's bind, nor while a
    restarted worker waits to bind it again. The sockets are held until all are bound (one bound
    and closed at a time, the kernel may hand out the same port twice: two pods' coordinators
    once collided so). Ephemeral ports only where there is no room below the range."""
    low, _ = ephemeral_range()
    below = list(range(max(1024, low - PORTS_BELOW_EPHEMERAL), low))
    random.shuffle(below)
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in below:
            if len(chosen) == count:
                break
            s = stack.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:     # in use (or in TIME_WAIT)
                continue
            chosen.append(port)
        while len(chosen) < count:
            s = stack.enter_context(socket.socket())
            s.bind((host, 0))
            chosen.append(s.getsockname()[1])
    return chosen


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        low, high = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high
