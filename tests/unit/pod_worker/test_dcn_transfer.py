"""State transfer over the data plane, in this process: a donor's leaves arrive bit for bit with
their step and fingerprint; a wrong secret, a cut stream, a stalled one, and chunks that do not
fit are refused or fail with a clear TransferError, and the staging buffers are never handed out."""
from __future__ import annotations

import concurrent.futures
import time

import ml_dtypes
import numpy as np
import pytest
import zmq

from multipod import protos
from multipod.pod_worker.dcn import (
    PHASE_STATE,
    PHASE_STATE_MANIFEST,
    Exchange,
    InvalidChunk,
    LeafSpec,
    Listener,
    StateReceiver,
    TransferError,
    send_state,
)
from multipod.pod_worker.dcn.connection import Connection, receive_any
from multipod.pod_worker.dcn.transport import ACK, DATA, HEADER, REFUSED
from tests.unit.pod_worker.test_dcn import SECRET, assert_bitwise, wait_for

TRANSFER = "run.transfer.0.1.abcd"
CHUNK = 96      # 24 float32 / int32 values per chunk: every leaf but the tiny ones spans several
FINGERPRINT = "blake2b:0123456789abcdef"


def state_leaves(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((7, 13)).astype(np.float32)
    weights[0, :3] = np.array([0x7FC00001, 0x7F800000, 0xFFC12345], np.uint32).view(np.float32)   # NaN payloads, inf
    return [weights, rng.standard_normal(101).astype(np.float32), np.array(12345, np.int32),
            rng.integers(-2**31, 2**31 - 1, size=(3, 17), dtype=np.int32), np.zeros((0,), np.float32),
            rng.standard_normal(29).astype(ml_dtypes.bfloat16)]


def specs_of(leaves) -> list[LeafSpec]:
    return [LeafSpec(tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves]


@pytest.fixture
def listeners():
    made = [Listener(i, "127.0.0.1:0", SECRET) for i in range(3)]
    yield made
    for lst in made:
        lst.close()


def donate(listeners, leaves, *, secret=SECRET, timeout=20.0, **kwargs):
    """send_state from pod 0 to pod 1, in a thread; returns its future."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(send_state, 0, TRANSFER, 1, listeners[1].address, leaves, 42, FINGERPRINT, secret,
                         time.monotonic() + timeout, chunk_bytes=CHUNK, **kwargs)
    pool.shutdown(wait=False)
    return future


@pytest.mark.parametrize("streams", [1, 3])
def test_the_state_arrives_bit_for_bit_with_its_step_and_fingerprint(listeners, streams):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    listeners[1].attach(receiver)
    sent = donate(listeners, leaves, streams=streams)
    step, fingerprint, got, nbytes = receiver.wait(time.monotonic() + 20)
    stats = sent.result(timeout=20)
    total = sum(leaf.nbytes for leaf in leaves)
    assert (step, fingerprint, nbytes) == (42, FINGERPRINT, total)
    assert stats.bytes == total and stats.seconds > 0
    for a, b in zip(got, leaves):
        assert_bitwise(a, b)
    assert listeners[1].refused == 0


def test_a_receiver_that_attaches_after_the_donor_connected_still_gets_it(listeners):
    # The controller asks both pods at once: the donor may connect before the receiver listens
    # for the transfer. Its manifest is repeated until acknowledged.
    leaves = state_leaves(1)
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    sent = donate(listeners, leaves)
    wait_for(lambda: listeners[1].refused >= 1)      # a manifest of a run pod 1 does not serve yet
    listeners[1].attach(receiver)
    _, _, got, _ = receiver.wait(time.monotonic() + 20)
    sent.result(timeout=20)
    for a, b in zip(got, leaves):
        assert_bitwise(a, b)


def test_the_exchange_works_again_once_its_inbox_is_reattached(listeners):
    leaves = state_leaves(2)
    addresses = [lst.address for lst in listeners[:2]]
    grad_specs = [LeafSpec((40,), np.dtype(np.float32))]
    exchanges = [Exchange("run", p, addresses, grad_specs, listeners[p], chunk_bytes=CHUNK, secret=SECRET)
                 for p in range(2)]
    try:
        receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
        listeners[1].attach(receiver)
        sent = donate(listeners, leaves)
        receiver.wait(time.monotonic() + 20)
        sent.result(timeout=20)
        listeners[1].attach(exchanges[1].inbox)
        grads = [np.full(40, 1.5, np.float32), np.full(40, 2.25, np.float32)]
        for ex in exchanges:
            ex.inbox.set_next_step(0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = [f.result(timeout=30) for f in [pool.submit(ex.all_reduce, 0, [g])
                                                      for ex, g in zip(exchanges, grads)]]
        for summed, _ in results:
            assert np.all(summed[0] == 3.75)
    finally:
        for ex in exchanges:
            ex.close()


def test_a_wrong_secret_is_refused(listeners):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    listeners[1].attach(receiver)
    sent = donate(listeners, leaves, secret="not-the-secret-of-this-run-at-all")
    with pytest.raises(TransferError, match="did not prove the run's secret"):
        sent.result(timeout=20)
    with pytest.raises(TransferError, match=rf"0 of {sum(leaf.nbytes for leaf in leaves)} bytes arrived within "
                                            rf"the deadline \(no manifest\)"):
        receiver.wait(time.monotonic() + 0.5)


def test_the_donor_learns_at_once_that_the_receiver_holds_another_state(listeners):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves[:-1]), chunk_bytes=CHUNK)
    listeners[1].attach(receiver)
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"pod 1 refused it: the donor's state has 6 leaves"):
        donate(listeners, leaves, timeout=30).result(timeout=30)
    assert time.monotonic() - start < 20


# -- cut off mid-stream ---------------------------------------------------------------------------
def partial_donor(address: str, leaves, chunks: int, pod: int = 0) -> Connection:
    """A donor that sends the manifest and only the first `chunks` chunks (the caller closes it)."""
    conn = Connection(zmq.Context.instance(), address, pod, 1, TRANSFER, SECRET)
    deadline = time.monotonic() + 10
    conn.handshake(deadline)
    total = sum(leaf.nbytes for leaf in leaves)
    conn.send(HEADER.pack(protos.PROTOCOL_VERSION, pod, 42, PHASE_STATE_MANIFEST, len(leaves), total),
              FINGERPRINT.encode(), deadline)
    _, reply = receive_any([conn], deadline, deadline)
    assert reply[0] == ACK
    sent = 0
    for i, leaf in enumerate(leaves):
        flat = leaf.reshape(-1)
        per = CHUNK // leaf.dtype.itemsize
        for a in range(0, flat.size, per):
            if sent == chunks:
                return conn
            conn.send(HEADER.pack(protos.PROTOCOL_VERSION, pod, 42, PHASE_STATE, i, a),
                      flat[a:a + per].view(np.uint8), deadline)
            sent += 1
    return conn


def test_a_stream_cut_mid_way_fails_saying_how_much_arrived(listeners):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    listeners[1].attach(receiver)
    conn = partial_donor(listeners[1].address, leaves, 3)
    wait_for(lambda: receiver._bytes == 3 * CHUNK)
    conn.close()        # the donor dies
    total = sum(leaf.nbytes for leaf in leaves)
    with pytest.raises(TransferError, match=rf"pod 0 failed: its data-plane connection closed after {3 * CHUNK} of "
                                            rf"{total} bytes arrived"):
        receiver.wait(time.monotonic() + 30)      # from the broken connection, long before the deadline
    with pytest.raises(TransferError):
        receiver.wait(time.monotonic() + 1)       # and never the staging buffers later


def test_a_stalled_stream_fails_at_the_deadline_and_refuses_the_rest(listeners):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    listeners[1].attach(receiver)
    conn = partial_donor(listeners[1].address, leaves, 2)
    try:
        wait_for(lambda: receiver._bytes == 2 * CHUNK)
        with pytest.raises(TransferError, match=rf"{2 * CHUNK} of \d+ bytes arrived within the deadline "
                                                rf"\(manifest received\)"):
            receiver.wait(time.monotonic() + 0.3)
        with pytest.raises(InvalidChunk, match="already failed"):
            receiver.receive(0, 42, PHASE_STATE, 1, 0, np.zeros(24, np.float32).tobytes())
    finally:
        conn.close()


# -- chunks that do not fit -------------------------------------------------------------------------
def test_chunks_from_another_pod_are_refused_on_the_wire(listeners):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    listeners[1].attach(receiver)
    conn = Connection(zmq.Context.instance(), listeners[1].address, 2, 1, TRANSFER, SECRET)
    try:
        conn.handshake(time.monotonic() + 10)      # pod 2 holds the secret, but is not the donor
        total = sum(leaf.nbytes for leaf in leaves)
        conn.socket.send_multipart([DATA, HEADER.pack(protos.PROTOCOL_VERSION, 2, 42, PHASE_STATE_MANIFEST,
                                                      len(leaves), total), FINGERPRINT.encode()])
        _, reply = receive_any([conn], time.monotonic() + 10, time.monotonic() + 10)
    finally:
        conn.close()
    assert reply[0] == REFUSED and b"pod 2 is not the donor" in reply[1]
    assert "not the donor" in listeners[1].refusals[-1]
    assert receiver._manifest is None
    with pytest.raises(TransferError, match="the last refused chunk: .*pod 2 is not the donor"):
        receiver.wait(time.monotonic() + 0.2)


@pytest.mark.parametrize("frame,message", [
    ((42, PHASE_STATE, 0, 0, None), "before the manifest"),
    ((42, PHASE_STATE_MANIFEST, 5, None, FINGERPRINT.encode()), "6 leaves of"),
    ((42, PHASE_STATE_MANIFEST, 6, None, b"\xff\xfe"), "not ASCII"),
])
def test_a_manifest_that_does_not_fit_is_refused(frame, message):
    leaves = state_leaves()
    receiver = StateReceiver(TRANSFER, 1, 0, specs_of(leaves), chunk_bytes=CHUNK)
    step, phase, leaf, offset, payload = frame
    total = sum(x.nbytes for x in leaves)
    with pytest.raises(InvalidChunk, match=message):
        receiver.receive(0, step, phase, leaf, total if offset is None else offset,
                         payload if payload is not None else np.zeros(24, np.float32).tobytes())


@pytest.mark.parametrize("pod,step,phase,leaf,offset,size,message", [
    (2, 42, PHASE_STATE, 1, 0, 96, "pod 2 is not the donor"),
    (0, 41, PHASE_STATE, 1, 0, 96, "step 41"),
    (0, 42, 3, 1, 0, 96, "phase 3"),
    (0, 42, PHASE_STATE, 6, 0, 96, "leaf 6 out of range"),
    (0, 42, PHASE_STATE, 1, 12, 96, "not on the grid"),
    (0, 42, PHASE_STATE, 1, 120, 96, "not on the grid"),       # past the end of 101 values
    (0, 42, PHASE_STATE, 1, 96, 96, "expected 20"),           # the last chunk holds 5 values
    (0, 42, PHASE_STATE, 1, 24, 95, "expected 96"),
])
def test_a_chunk_that_does_not_fit_is_refused_and_writes_nothing(pod, step, phase, leaf, offset, size, message):
    leaves = state_leaves()
    specs = specs_of(leaves)
    receiver = StateReceiver(TRANSFER, 1, 0, specs, chunk_bytes=CHUNK)
    total = sum(x.nbytes for x in leaves)
    assert receiver.receive(0, 42, PHASE_STATE_MANIFEST, len(specs), total, FINGERPRINT.encode()) == b"manifest"
    before = [buf.copy() for buf in receiver._staging]
    with pytest.raises(InvalidChunk, match=message):
        receiver.receive(pod, step, phase, leaf, offset, b"\x07" * size)
    assert receiver._bytes == 0 and all(not seen for seen in receiver._seen)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, receiver._staging))


def test_a_duplicate_chunk_or_a_different_manifest_is_refused():
    leaves = state_leaves()
    specs = specs_of(leaves)
    receiver = StateReceiver(TRANSFER, 1, 0, specs, chunk_bytes=CHUNK)
    total = sum(x.nbytes for x in leaves)
    manifest = (0, 42, PHASE_STATE_MANIFEST, len(specs), total)
    assert receiver.receive(*manifest, FINGERPRINT.encode()) == b"manifest"
    assert receiver.receive(*manifest, FINGERPRINT.encode()) == b"manifest"     # a repeat is fine
    with pytest.raises(InvalidChunk, match="unlike the first"):
        receiver.receive(*manifest, b"another-fingerprint")
    receiver.receive(0, 42, PHASE_STATE, 1, 24, np.ones(24, np.float32).tobytes())
    with pytest.raises(InvalidChunk, match="duplicate chunk at offset 24"):
        receiver.receive(0, 42, PHASE_STATE, 1, 24, np.full(24, 9, np.float32).tobytes())
    assert np.all(receiver._staging[1][24:48] == 1.0)
