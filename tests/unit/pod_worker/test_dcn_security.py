"""Security of the data plane, in this process: connections without the secret, with a wrong
one, or claiming another pod are refused while the legitimate pods' step goes on; the secret never
crosses the wire; the handshake proves the listener too; the loopback rule for starting a worker."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from multipod import protos
from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.transport import (
    CHALLENGE,
    DATA,
    HELLO,
    NONCE_BYTES,
    OK,
    PODS,
    PROOF,
    REFUSED,
    LinkError,
    handshake_proof,
    handshake_transcript,
)
from tests.helpers import cli_env
from tests.unit.pod_worker.test_dcn import RUN, SECRET, assert_bitwise, gradients, pod_order_sum, send_chunk, wait_for


@pytest.fixture
def pods():
    from tests.unit.pod_worker.test_dcn import Pods
    made = Pods(3)
    yield made
    made.close()


def raw_handshake(address: str, pod: int, peer: int, secret: str, sniff: list | None = None):
    """A client that runs the handshake by hand with `secret` (not checking the listener's proof),
    so the listener is the one that must refuse. Returns (socket, the listener's last reply)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(address.replace("curve://", "tcp://"))
    nonce_c = os.urandom(NONCE_BYTES)
    hello = [HELLO, PODS.pack(protos.PROTOCOL_VERSION, pod, peer), nonce_c, RUN.encode()]
    sock.send_multipart(hello)
    reply = sock.recv_multipart()
    if sniff is not None:
        sniff += hello + reply
    if reply[0] != CHALLENGE:
        return sock, reply
    transcript = handshake_transcript(pod, peer, nonce_c, reply[1], RUN.encode())
    proof = [PROOF, handshake_proof(secret, b"client", transcript)]
    sock.send_multipart(proof)
    reply = sock.recv_multipart()
    if sniff is not None:
        sniff += proof + reply
    return sock, reply


def run_step_during(pods, step: int, attack) -> None:
    """The three pods exchange step `step` while `attack()` runs; the sums must be exact."""
    grads = gradients(3, seed=step)
    for ex in pods.exchanges:
        ex.inbox.set_next_step(step)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ex.all_reduce, step, g) for ex, g in zip(pods.exchanges, grads)]
        attack()
        results = [f.result(timeout=60) for f in futures]
    for summed, _ in results:
        for got, want in zip(summed, pod_order_sum(grads)):
            assert_bitwise(np.asarray(got), want)


@pytest.mark.parametrize("secret", ["", "wrong-secret-of-the-same-size!!!", SECRET[:-1]])
def test_connection_without_the_right_secret_is_refused_and_the_step_goes_on(pods, secret):
    listener = pods.listeners[0]
    replies = []

    def attack():
        sock, reply = raw_handshake(pods.addresses[0], 1, 0, secret)
        replies.append(reply)
        sock.send_multipart([DATA, b"\0" * 29, b"\0" * 64])    # and data anyway: dropped
        sock.close()
    run_step_during(pods, 0, attack)
    assert replies[0][0] == REFUSED and b"did not prove the run's secret" in replies[0][1]
    assert any("did not prove" in r for r in listener.refusals)


def test_data_without_a_handshake_is_refused(pods):
    def attack():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pods.addresses[0])
        sock.send_multipart([DATA, b"\0" * 29, b"\0" * 64])
        wait_for(lambda: pods.listeners[0].refused >= 1)
        sock.close()
    run_step_during(pods, 0, attack)
    assert "has not proved the secret" in pods.listeners[0].refusals[-1]


def test_a_connection_claiming_another_pod_is_refused(pods):
    listener = pods.listeners[0]

    def attack():
        # Pod 2, authenticated, sends a chunk in pod 1's name.
        conn = Connection(zmq.Context.instance(), pods.addresses[0], 2, 0, RUN, SECRET)
        conn.handshake(time.monotonic() + 10)
        send_chunk(conn, np.zeros(2, np.float32).tobytes(), pod=1, phase=1, leaf=1, offset=0)
        wait_for(lambda: any("claiming pod 1" in r for r in listener.refusals))
        conn.close()
        # A HELLO in the listener's own name.
        sock, reply = raw_handshake(pods.addresses[0], 0, 0, SECRET)
        sock.close()
        assert reply[0] == REFUSED
    run_step_during(pods, 0, attack)
    assert any("claiming pod 1 on a connection bound to pod 2" in r for r in listener.refusals)


def test_the_secret_never_crosses_the_wire_and_the_listener_proves_it_too(pods):
    sniffed: list[bytes] = []
    sock, reply = raw_handshake(pods.addresses[0], 1, 0, SECRET, sniffed)
    sock.close()
    assert reply == [OK]
    assert not any(SECRET.encode() in frame for frame in sniffed)
    # A listener that does not hold the secret is found out by the client.
    from multipod.pod_worker.dcn import Listener
    impostor = Listener(1, "127.0.0.1:0", "an-impostor-without-the-secret!")
    conn = Connection(zmq.Context.instance(), impostor.address, 0, 1, RUN, SECRET)
    try:
        with pytest.raises(LinkError, match="did not prove the run's secret"):
            conn.handshake(time.monotonic() + 10)
    finally:
        conn.close()
        impostor.close()


@pytest.mark.parametrize("flags,refused", [
    (["--listen", "0.0.0.0:0"], True),
    (["--listen", "127.0.0.1:0", "--dcn-listen", "0.0.0.0:0"], True),
    (["--listen", "127.0.0.1:0", "--dcn-listen", "0.0.0.0:0", "--dcn-encrypt"], False),
])
def test_a_worker_beyond_loopback_without_encryption_refuses_to_start(flags, refused):
    env = cli_env()
    env["MULTIPOD_AUTH_TOKEN"] = SECRET
    cmd = [sys.executable, "-m", "multipod.cli", "worker", "--pod-index", "0", *flags]
    if refused:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode != 0
        assert "refusing to listen beyond loopback unencrypted" in result.stderr and "--insecure" in result.stderr
        cmd.append("--insecure")
    # Allowed: it starts (we only wait for its port file, then stop it; nothing leaves the machine).
    port_file = f"/tmp/multipod-test-{os.getpid()}-{len(flags)}.port"
    proc = subprocess.Popen([*cmd, "--port-file", port_file], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)
        with open(f"{port_file}.dcn") as f:
            assert f.read().startswith("curve://" if "--dcn-encrypt" in flags else "tcp://")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for path in (port_file, f"{port_file}.dcn"):
            if os.path.exists(path):
                os.unlink(path)
