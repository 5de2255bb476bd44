"""The committed gRPC stubs are exactly what protoc generates from multipod.proto."""
import pathlib

import pytest

from multipod.protos import regenerate_stubs as generate


def test_regenerating_stubs_changes_nothing(tmp_path: pathlib.Path):
    pytest.importorskip("grpc_tools")
    generate.generate(tmp_path)
    for name in generate.STUBS:
        committed = (generate.PROTO_DIR / name).read_text()
        fresh = (tmp_path / name).read_text()
        assert fresh == committed, (f"{name} is stale: run `python -m multipod.protos.regenerate_stubs` "
                                    f"(with the grpcio-tools version pinned in pyproject.toml)")


def test_services_are_complete():
    from multipod.protos import multipod_pb2 as pb
    worker = pb.DESCRIPTOR.services_by_name["PodWorker"]
    assert {m.name for m in worker.methods} >= {"Configure", "Step", "Save", "Restore", "Evaluate",
                                                 "Status", "Shutdown"}
    # Gradients travel on the data plane (pod_worker/dcn/); gRPC only says where it listens.
    assert set(pb.DESCRIPTOR.services_by_name) == {"PodWorker"}
    assert "dcn_address" in pb.StatusReply.DESCRIPTOR.fields_by_name
    assert "dcn_addresses" in pb.ConfigureRequest.DESCRIPTOR.fields_by_name
