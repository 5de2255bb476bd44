"""A pod's worker served in the test process, configured over gRPC as the only pod of a run: the
harness of the tests that talk to one worker through its gRPC adapter."""
from __future__ import annotations

import pytest

from multipod import protos
from multipod.pod_worker.server import start_server
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import Security, open_channel


class InProcessWorker:
    """A worker on a free local port with a channel and stub to it, configured with `config` (a
    WorkerConfig) as pod 0 of 1 under run_id. Subclasses add the calls their tests make."""

    def __init__(self, config, run_id: str):
        self.server, self.service, _, port = start_server(0, "127.0.0.1:0", Security())
        self.pod = self.service.pod
        self.address = f"127.0.0.1:{port}"
        self.channel = open_channel(self.address, Security())
        self.stub = pb_grpc.PodWorkerStub(self.channel)
        self.stub.Configure(pb.ConfigureRequest(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=1, peer_addresses=[self.address],
            worker_config_json=config.to_json(), run_id=run_id), timeout=300)

    def close(self) -> None:
        """Close the channel and stop the server."""
        self.channel.close()
        self.server.stop(0)


def module_worker(factory):
    """A module-scoped pytest fixture named `worker`: factory() (an InProcessWorker) started once for
    the module's tests and closed after them. Use as `worker = module_worker(...)` in a test module."""
    @pytest.fixture(scope="module", name="worker")
    def fixture():
        w = factory()
        yield w
        w.close()
    return fixture
