"""The options every gRPC channel and server gets (protos.channel_options): keepalive that the
server accepts, and a listening port that a second server cannot bind."""
from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from multipod import protos
from multipod.protos import channels as transport
from multipod.protos.channels import Security, add_port, open_channel


def _server(options) -> tuple[grpc.Server, int]:
    """A server built as the worker builds its own (start_server), serving the health service."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = add_port(server, "127.0.0.1:0", Security())
    assert port
    server.start()
    return server, port


def test_options_carry_keepalive_that_the_server_accepts():
    options = dict(protos.channel_options())
    keepalive = options["grpc.keepalive_time_ms"]
    assert 1_000 <= keepalive <= 300_000                      # minutes at most: NATs drop idle flows
    assert 0 < options["grpc.keepalive_timeout_ms"] <= 60_000
    assert options["grpc.keepalive_permit_without_calls"] == 1   # idle channels are pinged too
    assert options["grpc.http2.max_pings_without_data"] == 0     # ... and not only twice
    # The server's floor between pings is below the clients' interval: no ping is a strike.
    assert 0 < options["grpc.http2.min_ping_interval_without_data_ms"] < keepalive
    assert options["grpc.so_reuseport"] == 0
    short = dict(protos.channel_options(keepalive_time_ms=100))
    assert short["grpc.http2.min_ping_interval_without_data_ms"] < short["grpc.keepalive_time_ms"] == 100


@pytest.mark.parametrize("security", [Security(), Security(token="t" * 20)])
def test_open_channel_uses_the_options(monkeypatch, security):
    seen = {}

    def insecure_channel(address, options=None):
        seen.update(options)
        return real(address, options=options)
    real = grpc.insecure_channel
    monkeypatch.setattr(transport.grpc, "insecure_channel", insecure_channel)
    open_channel("127.0.0.1:1", security).close()
    assert seen == dict(protos.channel_options())


def test_an_idle_channel_with_keepalive_stays_connected():
    """Both ends with a 100 ms keepalive, idle for several pings (gRPC sends at most about one a
    second): the server never answers GOAWAY too_many_pings, so the connection never drops. (With
    the server's default ping policy the same channel is sent away within those 5 s.)"""
    options = protos.channel_options(keepalive_time_ms=100)
    server, port = _server(options)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        time.sleep(5.0)     # idle: only keepalive pings cross the connection
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        connected = states.index(grpc.ChannelConnectivity.READY)
        assert set(states[connected:]) == {grpc.ChannelConnectivity.READY}, states   # never dropped
    finally:
        channel.unsubscribe(states.append)
        channel.close()
        server.stop(0)


def test_a_second_server_cannot_bind_a_port_in_use():
    first, port = _server(protos.channel_options())
    try:
        second = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=protos.channel_options())
        assert add_port(second, f"127.0.0.1:{port}", Security()) == 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:     # the first one serves on
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        first.stop(0)
