"""ProbeLink (pod_worker/link_probe.py, server.py): two workers in this process time rounds of
their data-plane exchange; a malformed request gets INVALID_ARGUMENT naming its field, and the
worker keeps serving (and probing) after it. With measure_encryption, a worker times its own data
plane over loopback with CURVE and without (pod_worker/dcn/curve_rate.py)."""
from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from multipod import protos
from multipod.pod_worker.dcn import curve_rate
from multipod.pod_worker.server import start_server
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import Security, open_channel


@pytest.fixture(scope="module")
def workers():
    started = [start_server(pod, "127.0.0.1:0", Security()) for pod in range(2)]
    channels = [open_channel(f"127.0.0.1:{port}", Security()) for _, _, _, port in started]
    stubs = [pb_grpc.PodWorkerStub(c) for c in channels]
    dcn = [service.pod.listener.address for _, service, _, _ in started]
    yield stubs, dcn
    for channel in channels:
        channel.close()
    for server, service, _, _ in started:
        server.stop(0)
        service.pod.close()


def _request(dcn, pod: int, run_id: str = "probe-1", **fields) -> pb.ProbeLinkRequest:
    values = dict(protocol_version=protos.PROTOCOL_VERSION, run_id=run_id, pod_index=pod, dcn_addresses=dcn,
                  bytes=1 << 20, streams=2, chunk_bytes=1 << 20, rounds=3)
    values.update(fields)
    return pb.ProbeLinkRequest(**values)


def _probe_both(stubs, dcn, run_id: str, **fields) -> list[pb.ProbeLinkReply]:
    """Prepare on both pods, then run on both (as controller/tune/dcn_probe.py does)."""
    for pod in range(2):
        assert not stubs[pod].ProbeLink(_request(dcn, pod, run_id, prepare=True, **fields), timeout=30).seconds
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(stubs[p].ProbeLink, _request(dcn, p, run_id, **fields), timeout=30) for p in range(2)]
        return [c.result() for c in calls]


def test_two_pods_time_rounds_of_their_exchange(workers):
    stubs, dcn = workers
    replies = _probe_both(stubs, dcn, "probe-a")
    for reply in replies:
        assert len(reply.seconds) == 3 and all(s > 0 for s in reply.seconds)
        assert reply.bytes_sent == 1 << 20           # float32 on the wire, the whole buffer to the peer
        assert reply.encrypted is False
    compressed = _probe_both(stubs, dcn, "probe-b", compression="int8")
    assert compressed[0].bytes_sent < (1 << 20) // 3     # int8 + a scale per 256 values


@pytest.mark.parametrize("field, value, named", [
    ("bytes", 0, "bytes"), ("bytes", 6, "bytes"), ("streams", 0, "streams"), ("streams", 10_000, "streams"),
    ("chunk_bytes", 5, "chunk_bytes"), ("rounds", 0, "rounds"), ("compression", "zip", "compression"),
    ("run_id", "", "run_id"), ("pod_index", 7, "pod_index"), ("dcn_addresses", ["x"], "dcn_addresses"),
])
def test_a_malformed_request_is_refused_naming_its_field_and_the_worker_serves_on(workers, field, value, named):
    stubs, dcn = workers
    with pytest.raises(grpc.RpcError) as caught:
        stubs[0].ProbeLink(_request(dcn, 0, **{field: value}), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details()
    assert stubs[0].Status(pb.StatusRequest(), timeout=10).pod_index == 0


def test_wrong_version_or_pod_is_a_failed_precondition_and_a_lone_pod_fails_in_time(workers):
    stubs, dcn = workers
    with pytest.raises(grpc.RpcError) as caught:
        stubs[0].ProbeLink(_request(dcn, 0, protocol_version=1), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as caught:
        stubs[1].ProbeLink(_request(dcn, 0), timeout=10)     # worker 1 is pod 1
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as caught:           # pod 1 never takes part: no answer hangs
        stubs[0].ProbeLink(_request(dcn, 0, "probe-alone"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(_probe_both(stubs, dcn, "probe-c")[0].seconds) == 3     # and probing works again


def _encryption_request(pod: int, **fields) -> pb.ProbeLinkRequest:
    values = dict(protocol_version=protos.PROTOCOL_VERSION, pod_index=pod, chunk_bytes=1 << 20,
                  measure_encryption=True, encryption_seconds=0.05)
    values.update(fields)
    return pb.ProbeLinkRequest(**values)


def test_the_data_plane_is_timed_on_its_host_with_curve_and_without_within_its_budget():
    start = time.monotonic()
    rates = curve_rate.measure(1 << 20, 0.05, deadline=time.monotonic() + 30)
    assert rates.curve_bytes_per_s > 0 and rates.plain_bytes_per_s > 0
    # Within the rates' own budget (two times 0.05 s) plus setup, nowhere near the deadline.
    assert time.monotonic() - start < 10


def test_a_loopback_pair_that_cannot_finish_by_its_deadline_is_a_rate_error():
    with pytest.raises(curve_rate.RateError):
        curve_rate.rate(1 << 20, True, 0.05, deadline=time.monotonic())


def test_the_encryption_probe_replies_both_rates_through_the_rpc(workers):
    stubs, _ = workers
    reply = stubs[1].ProbeLink(_encryption_request(1), timeout=30)
    assert reply.curve_bytes_per_s > 0 and reply.plain_bytes_per_s > 0
    assert not reply.seconds and reply.encrypted is False


@pytest.mark.parametrize("field, value", [
    ("chunk_bytes", 5), ("chunk_bytes", 64 << 20), ("encryption_seconds", 0.0), ("encryption_seconds", -1.0),
    ("encryption_seconds", 5.0), ("encryption_seconds", float("nan")),
])
def test_a_malformed_encryption_probe_is_refused_naming_its_field_and_the_worker_serves_on(workers, field, value):
    stubs, _ = workers
    with pytest.raises(grpc.RpcError) as caught:
        stubs[0].ProbeLink(_encryption_request(0, **{field: value}), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    assert stubs[0].Status(pb.StatusRequest(), timeout=10).pod_index == 0
    with pytest.raises(grpc.RpcError) as caught:        # worker 1 is pod 1
        stubs[1].ProbeLink(_encryption_request(0), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
