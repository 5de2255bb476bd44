"""Security of a pod worker, in this process: the shared token on the control plane, TLS with
client certificates, and malformed input on both planes (random bytes, truncated messages and
frames, oversized ones, chunks off the grid, of the wrong size, duplicated, in another pod's name)
that is refused while the worker keeps training. The worker is pod 0 of 2; pod 1 is a bare
exchange in this process (tests/unit/pod_worker/test_dcn_security.py has the handshake's refusals)."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from multipod import protos
from multipod.pod_worker.dcn import Exchange, Listener
from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.transport import DATA, HEADER, MAX_FRAME_BYTES
from multipod.pod_worker.server import MAX_PODS, start_server
from multipod.protos import codec, multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import TOKEN_HEADER, Security, SecurityError, open_channel
from tests.helpers import cli_env, tiny_worker_config

TOKEN = "correct-horse-battery-staple-42"
CONFIG = tiny_worker_config()
ROWS, COLS = CONFIG.train.global_batch // 2, CONFIG.train.seq_len + 1
RUN = "security-test"
# Unary methods that refuse garbage (Shutdown/Status accept any parseable bytes by design: an
# empty request; Save/Restore touch the file system and are covered by the checkpoint tests).
FUZZED = {"Step": pb.StepRequest, "Configure": pb.ConfigureRequest, "Evaluate": pb.EvaluateRequest,
          "Generate": pb.GenerateRequest}
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


class Worker:
    """One configured pod (pod 0 of 2) serving on loopback with the token required; pod 1 is a
    bare exchange in this process that sends zero gradients."""

    def __init__(self):
        self.server, self.service, _, port = start_server(0, "127.0.0.1:0", Security(token=TOKEN))
        self.address = f"127.0.0.1:{port}"
        self.good = open_channel(self.address, Security(token=TOKEN))
        self.stub = pb_grpc.PodWorkerStub(self.good)
        self.listener = self.service.pod.listener
        self.peer_listener = Listener(1, "127.0.0.1:0", TOKEN)
        dcn = [self.stub.Status(pb.StatusRequest(), timeout=10).dcn_address, self.peer_listener.address]
        self.stub.Configure(pb.ConfigureRequest(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=2, peer_addresses=[self.address] * 2,
            worker_config_json=CONFIG.to_json(), run_id=RUN, dcn_addresses=dcn), timeout=300)
        self.specs = self.service.pod.trainer.leaf_specs
        self.peer = Exchange(RUN, 1, dcn, self.specs, self.peer_listener, timeout_s=60, secret=TOKEN)
        self.step = 0

    def train_one_step(self) -> pb.StepReply:
        tokens = np.random.default_rng(self.step).integers(0, 256, (ROWS, COLS), dtype=np.int32)
        zeros = [np.zeros(s.shape, s.dtype) for s in self.specs]
        self.peer.inbox.set_next_step(self.step)
        # Pod 1 votes that it starts the step from pod 0's state, as a healthy peer does.
        self.peer.send_vote(self.step, int(self.service.pod._checksum[1], 16))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            peer = pool.submit(self.peer.all_reduce, self.step, zeros)
            reply = self.stub.Step(pb.StepRequest(step=self.step, tokens=codec.encode(tokens),
                                                  global_tokens=2 * ROWS * (COLS - 1), run_id=RUN), timeout=60)
            summed, _ = peer.result(timeout=60)
        assert not np.all(np.asarray(summed[0]) == 0)       # pod 1 got pod 0's gradient
        self.step += 1
        return reply

    def pod1(self) -> Connection:
        """One connection in pod 1's name, kept open for the whole module: chunks it delivers
        (zeros, like the real pod 1's) stay delivered, so closing it cannot fail a step."""
        if getattr(self, "_pod1", None) is None:
            self._pod1 = self.connect_as(1)
        return self._pod1

    def connect_as(self, pod: int, run: str = RUN) -> Connection:
        """A data-plane connection to the worker that proved the secret as `pod`."""
        import zmq
        conn = Connection(zmq.Context.instance(), self.listener.address, pod, 0, run, TOKEN)
        conn.handshake(time.monotonic() + 10)
        return conn

    def refused_after(self, send) -> list[str]:
        """Run send(); return the refusals it caused (a sentinel frame marks the end)."""
        before = self.listener.refused
        send()
        deadline = time.monotonic() + 10
        while not (self.listener.refused > before and "b'SENTINEL'" in self.listener.refusals[-1]):
            assert time.monotonic() < deadline, "the listener did not get to the sentinel"
            time.sleep(0.01)
        count = self.listener.refused - before - 1
        return list(self.listener.refusals)[-1 - count:-1] if count else []


def _sentinel(sock) -> None:
    sock.send_multipart([b"SENTINEL"])


def _chunk(step: int, payload: bytes, pod: int = 1, phase: int = 0, leaf: int = 0, offset: int = 0,
           version: int = protos.PROTOCOL_VERSION) -> list[bytes]:
    return [DATA, HEADER.pack(version, pod, step, phase, leaf, offset), payload]


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    if getattr(w, "_pod1", None) is not None:
        w._pod1.close()
    w.peer.close()
    w.peer_listener.close()
    w.good.close()
    w.server.stop(0)
    w.service.pod.close()


def _raw(channel: grpc.Channel, method: str):
    """A unary callable that sends raw bytes (no serialisation) to `method`."""
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


@pytest.mark.parametrize("token", [None, "", "wrong-token-of-the-same-size!!!", TOKEN[:-1], TOKEN + "x"])
def test_missing_or_wrong_token_is_refused_on_the_control_plane(worker, token):
    channel = grpc.insecure_channel(worker.address)
    metadata = None if token is None else [(TOKEN_HEADER, token)]
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.PodWorkerStub(channel).Status(pb.StatusRequest(), timeout=10, metadata=metadata)
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


def _raw_socket(worker):
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker.listener.address)
    return sock


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(st.lists(st.binary(max_size=64), min_size=1, max_size=5), min_size=1, max_size=4))
def test_random_data_plane_frames_are_refused(worker, messages):
    # Without the handshake: every message is refused, one by one.
    sock = _raw_socket(worker)
    try:
        before = worker.listener.refused
        for message in messages:
            sock.send_multipart(message)
        deadline = time.monotonic() + 10
        while worker.listener.refused < before + len(messages):
            assert time.monotonic() < deadline, "not every message was refused"
            time.sleep(0.01)
    finally:
        sock.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(step=st.integers(0, 3), phase=st.integers(0, 3), leaf=st.integers(0, 12), offset=st.integers(0, 5000),
       size=st.integers(0, 5000), version=st.sampled_from([protos.PROTOCOL_VERSION, 0, 65535]))
def test_random_chunk_headers_from_an_authenticated_peer_are_checked(worker, step, phase, leaf, offset, size, version):
    # Zero payloads: a chunk that happens to be valid carries what pod 1 sends anyway (zeros).
    conn = worker.pod1()
    refused = worker.refused_after(lambda: (
        conn.socket.send_multipart(_chunk(worker.step + step, b"\0" * size, 1, phase, leaf, offset, version)),
        _sentinel(conn.socket)))
    spec = worker.specs[leaf] if leaf < len(worker.specs) else None
    valid = (version == protos.PROTOCOL_VERSION and step <= 1 and phase == 0 and spec is not None
             and offset == 0 and size == spec.nbytes)
    if not valid:
        assert len(refused) == 1, (step, phase, leaf, offset, size, version)


def test_offset_size_and_duplicate_checks_are_reached(worker):
    spec = worker.specs[0]
    conn = worker.pod1()
    refused = worker.refused_after(lambda: [conn.socket.send_multipart(m) for m in (
        _chunk(worker.step, b"\0" * spec.nbytes, offset=4),             # off the chunk grid
        _chunk(worker.step, b"\0" * (spec.nbytes - 4)),                  # wrong size
        _chunk(worker.step, b"\0" * spec.nbytes),                        # valid (zeros, like pod 1's)
        _chunk(worker.step, b"\1" * spec.nbytes),                        # duplicate: must not overwrite
    )] + [_sentinel(conn.socket)])
    assert len(refused) == 3
    assert "grid" in refused[0] and "expected" in refused[1] and "duplicate" in refused[2]


def test_truncated_messages_are_refused_with_invalid_argument(worker):
    tokens = np.zeros((ROWS, COLS), np.int32)
    whole = pb.StepRequest(step=worker.step, tokens=codec.encode(tokens), global_tokens=ROWS * (COLS - 1), run_id=RUN)
    data = whole.SerializeToString()
    for cut in (1, 7, len(data) // 2, len(data) - 1):
        with pytest.raises(grpc.RpcError) as info:
            _raw(worker.good, "/multipod.PodWorker/Step")(data[:cut], timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (cut, info.value.details())
    # Data frames cut short: a header missing bytes, a frame without its payload part.
    conn = worker.pod1()
    whole = _chunk(worker.step, b"\0" * worker.specs[0].nbytes)
    refused = worker.refused_after(lambda: (conn.socket.send_multipart([whole[0], whole[1][:-3], whole[2]]),
                                            conn.socket.send_multipart(whole[:2]),
                                            _sentinel(conn.socket)))
    assert len(refused) == 2 and all("malformed data frame" in r for r in refused)


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
    # On the data plane: chunks in another pod's name, and a connection of another run.
    payload = b"\0" * worker.specs[0].nbytes
    conn = worker.pod1()
    refused = worker.refused_after(lambda: [conn.socket.send_multipart(_chunk(worker.step, payload, pod=p))
                                            for p in (0, 7)] + [_sentinel(conn.socket)])
    assert len(refused) == 2 and all("on a connection bound to pod 1" in r for r in refused)
    other = worker.connect_as(1, run="another-run")
    try:
        refused = worker.refused_after(lambda: (other.socket.send_multipart(_chunk(worker.step, payload)),
                                                _sentinel(other.socket)))
    finally:
        other.close()
    assert len(refused) == 1 and "not this pod's current run" in refused[0]


def test_wrong_pod_index_or_pod_count_is_refused(worker):
    base = dict(protocol_version=protos.PROTOCOL_VERSION, peer_addresses=[worker.address],
                worker_config_json=CONFIG.to_json(), run_id="security-test")
    for fields, code in ((dict(pod_index=3, num_pods=4), grpc.StatusCode.FAILED_PRECONDITION),
                         (dict(pod_index=0, num_pods=0), grpc.StatusCode.INVALID_ARGUMENT),
                         (dict(pod_index=0, num_pods=2), grpc.StatusCode.INVALID_ARGUMENT),
                         (dict(pod_index=0, num_pods=1, run_id=""), grpc.StatusCode.INVALID_ARGUMENT),
                         # More pods than a worker serves.
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
    # A data frame over the limit: libzmq drops the connection before any of it is used.
    import zmq
    from zmq.utils.monitor import parse_monitor_message
    conn = worker.connect_as(1)
    try:
        conn.socket.send_multipart(_chunk(worker.step, b"\0" * (MAX_FRAME_BYTES + 1)))
        assert conn._monitor.poll(10_000), "the oversized frame did not close the connection"
        assert parse_monitor_message(conn._monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
    finally:
        conn.close()


def test_the_worker_still_trains_after_all_that(worker):
    # Runs after the attacks above (pytest keeps file order): the pod is intact and steps on.
    first = worker.train_one_step()
    second = worker.train_one_step()
    assert first.step + 1 == second.step and first.checksum != second.checksum
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
