"""Security of a pod worker's gRPC server, in this process: the shared token on both services,
TLS with client certificates, and malformed input (random bytes, truncated messages and streams,
oversized messages) that is refused while the worker keeps training."""
from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from multipod import protos
from multipod.pod_worker.server import MAX_PODS, start_server
from multipod.protos import codec, multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.transport import TOKEN_HEADER, Security, SecurityError, open_channel
from tests.helpers import cli_env, tiny_worker_config

TOKEN = "correct-horse-battery-staple-42"
CONFIG = tiny_worker_config()
ROWS, COLS = CONFIG.train.global_batch, CONFIG.train.seq_len + 1
# Unary methods that refuse garbage (Shutdown/Status accept any parseable bytes by design: an
# empty request; Save/Restore touch the file system and are covered by the checkpoint tests).
FUZZED = {"Step": pb.StepRequest, "Configure": pb.ConfigureRequest, "Evaluate": pb.EvaluateRequest,
          "Generate": pb.GenerateRequest}
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


class Worker:
    """One configured pod (pod 0 of 1) serving on loopback with the token required."""

    def __init__(self):
        self.server, self.service, _, port = start_server(0, "127.0.0.1:0", Security(token=TOKEN))
        self.address = f"127.0.0.1:{port}"
        self.good = open_channel(self.address, Security(token=TOKEN))
        self.stub = pb_grpc.PodWorkerStub(self.good)
        self.stub.Configure(pb.ConfigureRequest(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=1, peer_addresses=[self.address],
            worker_config_json=CONFIG.to_json(), run_id="security-test"), timeout=300)
        self.step = 0

    def train_one_step(self) -> pb.StepReply:
        tokens = np.random.default_rng(self.step).integers(0, 256, (ROWS, COLS), dtype=np.int32)
        reply = self.stub.Step(pb.StepRequest(step=self.step, tokens=codec.encode(tokens),
                                              global_tokens=ROWS * (COLS - 1)), timeout=60)
        self.step += 1
        return reply


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.good.close()
    w.server.stop(0)


def _raw(channel: grpc.Channel, method: str):
    """A unary callable that sends raw bytes (no serialisation) to `method`."""
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


def _raw_stream(channel: grpc.Channel):
    return channel.stream_unary("/multipod.Dcn/PushGradients", request_serializer=None, response_deserializer=None)


def _chunk(**fields) -> pb.GradientChunk:
    base = dict(protocol_version=protos.PROTOCOL_VERSION, run_id="security-test", from_pod=1, step=0,
                leaf_index=0, dtype="float32", shape=[4], offset=0, data=b"\0" * 16)
    base.update(fields)
    return pb.GradientChunk(**base)


@pytest.mark.parametrize("token", [None, "", "wrong-token-of-the-same-size!!!", TOKEN[:-1], TOKEN + "x"])
def test_missing_or_wrong_token_is_refused_on_both_services(worker, token):
    channel = grpc.insecure_channel(worker.address)
    metadata = None if token is None else [(TOKEN_HEADER, token)]
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.PodWorkerStub(channel).Status(pb.StatusRequest(), timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.DcnStub(channel).PushGradients(iter([_chunk()]), timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Even a Shutdown without the token changes nothing.
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.PodWorkerStub(channel).Shutdown(pb.ShutdownRequest(), timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not worker.service.shutdown_event.is_set()
    channel.close()


def test_right_token_is_accepted_and_health_stays_open(worker):
    assert worker.stub.Status(pb.StatusRequest(), timeout=10).configured
    # The health service answers without the token (it tells nothing but SERVING).
    channel = grpc.insecure_channel(worker.address)
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="multipod.PodWorker"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(sorted(FUZZED)), payload=st.binary(min_size=1, max_size=512))
def test_random_bytes_are_refused(worker, method, payload):
    with pytest.raises(grpc.RpcError) as info:
        _raw(worker.good, f"/multipod.PodWorker/{method}")(payload, timeout=30)
    assert info.value.code() in REFUSALS, (method, info.value.code(), info.value.details())


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(chunks=st.lists(st.binary(min_size=1, max_size=256), min_size=1, max_size=4))
def test_random_gradient_streams_are_refused(worker, chunks):
    with pytest.raises(grpc.RpcError) as info:
        _raw_stream(worker.good)(iter(chunks), timeout=30)
    assert info.value.code() in REFUSALS, info.value.details()


def test_truncated_messages_are_refused_with_invalid_argument(worker):
    tokens = np.zeros((ROWS, COLS), np.int32)
    whole = pb.StepRequest(step=worker.step, tokens=codec.encode(tokens), global_tokens=ROWS * (COLS - 1))
    data = whole.SerializeToString()
    for cut in (1, 7, len(data) // 2, len(data) - 1):
        with pytest.raises(grpc.RpcError) as info:
            _raw(worker.good, "/multipod.PodWorker/Step")(data[:cut], timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (cut, info.value.details())
    # A stream whose second message is cut short, and one the client abandons midway.
    chunk = _chunk().SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        _raw_stream(worker.good)(iter([chunk, chunk[: len(chunk) // 2]]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def abandoned():
        yield chunk
        raise RuntimeError("the client goes away mid-stream")
    with pytest.raises(grpc.RpcError):
        _raw_stream(worker.good)(abandoned(), timeout=30)


def test_wrong_fields_are_refused_with_invalid_argument(worker):
    cases = [
        pb.StepRequest(step=worker.step, tokens=codec.encode(np.zeros((ROWS, COLS), np.float32)), global_tokens=1),
        pb.StepRequest(step=worker.step, tokens=codec.encode(np.zeros((ROWS + 1, COLS), np.int32)), global_tokens=1),
        pb.StepRequest(step=worker.step, tokens=codec.encode(np.full((ROWS, COLS), 10**6, np.int32)), global_tokens=1),
        pb.StepRequest(step=worker.step, tokens=codec.encode(np.zeros((ROWS, COLS), np.int32)), global_tokens=0),
    ]
    for request in cases:
        with pytest.raises(grpc.RpcError) as info:
            worker.stub.Step(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    for chunk in (_chunk(from_pod=0), _chunk(from_pod=7), _chunk(run_id="another-run"), _chunk(dtype="complex64")):
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.DcnStub(worker.good).PushGradients(iter([chunk]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_wrong_pod_index_or_pod_count_is_refused(worker):
    base = dict(protocol_version=protos.PROTOCOL_VERSION, peer_addresses=[worker.address],
                worker_config_json=CONFIG.to_json(), run_id="security-test")
    for fields, code in ((dict(pod_index=3, num_pods=4), grpc.StatusCode.FAILED_PRECONDITION),
                         (dict(pod_index=0, num_pods=0), grpc.StatusCode.INVALID_ARGUMENT),
                         (dict(pod_index=0, num_pods=2), grpc.StatusCode.INVALID_ARGUMENT),
                         (dict(pod_index=0, num_pods=1, run_id=""), grpc.StatusCode.INVALID_ARGUMENT),
                         # More pods than the worker's handler threads can serve without deadlock.
                         (dict(pod_index=0, num_pods=MAX_PODS + 1,
                               peer_addresses=[worker.address] * (MAX_PODS + 1)), grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as info:
            worker.stub.Configure(pb.ConfigureRequest(**{**base, **fields}), timeout=30)
        assert info.value.code() == code, (fields, info.value.details())


def test_workers_listen_on_loopback_by_default():
    from multipod.cli import build_parser
    args = build_parser().parse_args(["worker", "--pod-index", "0"])
    assert args.listen.startswith("127.0.0.1:")


def test_oversized_messages_are_refused(worker):
    big = b"\0" * (protos.MAX_MESSAGE_BYTES + 1024)
    with pytest.raises(grpc.RpcError) as info:
        _raw(worker.good, "/multipod.PodWorker/Step")(pb.StepRequest(tokens=big).SerializeToString(), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.DcnStub(worker.good).PushGradients(iter([_chunk(data=big)]), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_worker_still_trains_after_all_that(worker):
    # Runs after the attacks above (pytest keeps file order): the pod is intact and steps on.
    first = worker.train_one_step()
    second = worker.train_one_step()
    assert first.step + 1 == second.step and first.fingerprint != second.fingerprint
    assert np.isfinite(second.loss_sum) and not second.skipped


def _self_signed(tmp_path) -> tuple[str, str]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def test_tls_with_client_certificates(tmp_path):
    cert, key = _self_signed(tmp_path)
    # The self-signed certificate is its own CA: the server requires clients to present it.
    secure = Security(token=TOKEN, tls_cert=cert, tls_key=key, tls_ca=cert)
    server, _, _, port = start_server(0, "127.0.0.1:0", secure)
    address = f"127.0.0.1:{port}"
    try:
        channel = open_channel(address, secure)
        assert pb_grpc.PodWorkerStub(channel).Status(pb.StatusRequest(), timeout=10).pid > 0
        channel.close()
        # TLS but no client certificate: the handshake fails.
        no_cert = open_channel(address, Security(token=TOKEN, tls_ca=cert))
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PodWorkerStub(no_cert).Status(pb.StatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        no_cert.close()
        # Plain text to a TLS port: refused.
        plain = open_channel(address, Security(token=TOKEN))
        with pytest.raises(grpc.RpcError):
            pb_grpc.PodWorkerStub(plain).Status(pb.StatusRequest(), timeout=10)
        plain.close()
        # TLS with the certificate but the wrong token: still UNAUTHENTICATED.
        wrong = open_channel(address, Security(token="x" * 20, tls_cert=cert, tls_key=key, tls_ca=cert))
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PodWorkerStub(wrong).Status(pb.StatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong.close()
    finally:
        server.stop(0)


def test_bad_security_settings_are_named():
    with pytest.raises(SecurityError, match="at least"):
        Security(token="short").validate()
    with pytest.raises(SecurityError, match="--tls-key"):
        Security(tls_cert="/etc/hostname").validate()
    with pytest.raises(SecurityError, match="no such file"):
        Security(tls_cert="/no/such.pem", tls_key="/no/such.key").validate()


def test_worker_without_a_token_refuses_to_start():
    env = cli_env()
    env.pop("MULTIPOD_AUTH_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "multipod.cli", "worker", "--pod-index", "0",
                             "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    assert "no auth token" in result.stderr and "MULTIPOD_AUTH_TOKEN" in result.stderr
