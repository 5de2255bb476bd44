"""A standby worker (worker --spare, for hot-swap): it says it is a spare until a Configure gives it
a slot, keeps a failed configure's slot free for another, and is that pod for good once
configured; its data plane accepts no peer before it has a slot."""
from __future__ import annotations

import grpc
import pytest

from multipod import protos
from multipod.pod_worker.errors import InvalidRequest
from multipod.pod_worker.server import start_server
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import Security, open_channel
from tests.helpers import tiny_worker_config

CONFIG = tiny_worker_config()


@pytest.fixture
def spare():
    server, service, _, port = start_server(None, "127.0.0.1:0", Security())
    channel = open_channel(f"127.0.0.1:{port}", Security())
    yield pb_grpc.PodWorkerStub(channel), service
    channel.close()
    server.stop(0)
    service.pod.listener.close()


def _configure(stub, pod_index: int, config_json: str, num_pods: int = 2):
    return stub.Configure(pb.ConfigureRequest(
        protocol_version=protos.PROTOCOL_VERSION, pod_index=pod_index, num_pods=num_pods,
        peer_addresses=["a:1"] * num_pods, dcn_addresses=["tcp://127.0.0.1:1"] * num_pods,
        worker_config_json=config_json, run_id="spare-test"), timeout=300)


def test_a_spare_takes_the_slot_its_first_successful_configure_gives_it(spare, monkeypatch):
    stub, service = spare
    status = stub.Status(pb.StatusRequest(), timeout=10)
    assert status.spare and status.pod_index == -1 and not status.configured
    assert service.pod.listener.pod_index is None          # no peer's HELLO can name it yet

    # A configure that fails halfway leaves it a spare, free for any slot.
    def fail(*args):
        assert service.pod.pod_index == 1 and service.pod.listener.pod_index == 1     # it was taking slot 1
        raise InvalidRequest("the build failed")
    monkeypatch.setattr(service.pod, "_configure", fail)
    with pytest.raises(grpc.RpcError) as info:
        _configure(stub, 1, CONFIG.to_json())
    assert "the build failed" in info.value.details()
    monkeypatch.undo()
    status = stub.Status(pb.StatusRequest(), timeout=10)
    assert status.spare and status.pod_index == -1 and service.pod.listener.pod_index is None

    reply = _configure(stub, 1, CONFIG.to_json())
    assert reply.pod_index == 1
    status = stub.Status(pb.StatusRequest(), timeout=10)
    assert not status.spare and status.pod_index == 1 and status.configured
    assert service.pod.listener.pod_index == 1

    # From now on it is pod 1, as if started with --pod-index 1.
    with pytest.raises(grpc.RpcError) as info:
        _configure(stub, 0, CONFIG.to_json())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves pod 1, not pod 0" in info.value.details()


def test_a_spare_compiles_on_standby_and_takes_that_trainer_with_its_slot(spare):
    stub, service = spare
    reply = stub.Configure(pb.ConfigureRequest(
        protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=2, peer_addresses=["a:1"] * 2,
        dcn_addresses=["tcp://127.0.0.1:1"] * 2, worker_config_json=CONFIG.to_json(), run_id="spare-test.standby",
        standby=True), timeout=300)
    status = stub.Status(pb.StatusRequest(), timeout=10)
    assert status.spare and not status.configured and status.pod_index == -1     # still waiting for a slot
    compiled = service.pod._standby[2]
    assert reply.fingerprint == compiled.fingerprint()

    assert _configure(stub, 0, CONFIG.to_json(), num_pods=1).pod_index == 0      # another pod count: built anew
    assert service.pod.trainer is not compiled and service.pod._standby is None

    with pytest.raises(grpc.RpcError) as info:      # a pod with a slot does not compile on standby
        stub.Configure(pb.ConfigureRequest(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=2, peer_addresses=["a:1"] * 2,
            dcn_addresses=["tcp://127.0.0.1:1"] * 2, worker_config_json=CONFIG.to_json(), run_id="x", standby=True),
            timeout=60)
    assert "only a spare" in info.value.details()


def test_the_slot_s_configure_takes_the_standby_trainer(spare):
    stub, service = spare
    stub.Configure(pb.ConfigureRequest(
        protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=2, peer_addresses=["a:1"] * 2,
        dcn_addresses=["tcp://127.0.0.1:1"] * 2, worker_config_json=CONFIG.to_json(), run_id="spare-test.standby",
        standby=True), timeout=300)
    compiled = service.pod._standby[2]
    _configure(stub, 1, CONFIG.to_json())
    assert service.pod.trainer is compiled and service.pod.pod_index == 1
