"""A second worker cannot take the control-plane port of a running one: servers bind without
SO_REUSEPORT, so it stops with an error naming the address instead of sharing the port."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from multipod.pod_worker.server import start_server
from multipod.protos.channels import Security


def test_a_second_worker_on_the_same_port_stops_with_a_clear_error():
    server, service, _, port = start_server(0, "127.0.0.1:0", Security())
    try:
        address = f"127.0.0.1:{port}"
        with pytest.raises(SystemExit, match=f"pod 1: cannot listen on {address}"):
            start_server(1, address, Security())
        with grpc.insecure_channel(address) as channel:     # the first worker serves on
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)
        service.pod.close()
