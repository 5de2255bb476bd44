"""Ports picked before a worker starts (controller/launch/ports.py), for local pods and Ray's hosts."""
import ipaddress
import socket

import pytest

from multipod.controller.launch.ports import PORTS_BELOW_EPHEMERAL, ephemeral_range, free_ports


def test_free_ports_are_all_different_and_free():
    # Held together while chosen: one at a time, the kernel once gave two pods' coordinators the same port.
    for _ in range(20):
        ports = free_ports(8)
        assert len(set(ports)) == 8
        for port in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))      # nothing holds it any more
    assert free_ports(0) == []


def test_free_ports_lie_below_the_ephemeral_range_where_no_port_0_bind_lands():
    low, _ = ephemeral_range()
    ports = free_ports(4)
    assert all(low - PORTS_BELOW_EPHEMERAL <= port < low for port in ports), (ports, low)
    with socket.socket() as held:        # a port in use is passed over
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        for _ in range(20):
            assert ports[0] not in free_ports(4)


def test_a_ray_host_s_ports_lie_below_the_ephemeral_range_on_every_address():
    """Ray's hosts get theirs from the same place (a task on the host's node, binding every
    address): a port handed out by a bind to port 0 there was once taken by a connection before
    the actor's worker bound it, in every incarnation of the actor."""
    pytest.importorskip("ray")
    from multipod.controller.launch.ray_worker import free_ports as ray_free_ports
    low, _ = ephemeral_range()
    ip, ports = ray_free_ports(3)
    ipaddress.ip_address(ip)
    assert len(set(ports)) == 3 and all(low - PORTS_BELOW_EPHEMERAL <= port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))
