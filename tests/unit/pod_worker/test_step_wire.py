"""What a Step carries over the wire for issue 9: token batches in the narrowest dtype that holds
the vocabulary (uint8, uint16 or int32; anything else, or an id outside the vocabulary, is
refused with INVALID_ARGUMENT), the full hash only when the request asks for it, and the exposed
exchange time in the timings."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from multipod import protos
from multipod.pod_worker.server import start_server
from multipod.protos import codec, multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import Security, open_channel
from tests.helpers import tiny_worker_config

CONFIG = tiny_worker_config()
ROWS, COLS = CONFIG.train.global_batch, CONFIG.train.seq_len + 1


@pytest.fixture(scope="module")
def worker():
    server, service, _, port = start_server(0, "127.0.0.1:0", Security())
    address = f"127.0.0.1:{port}"
    channel = open_channel(address, Security())
    stub = pb_grpc.PodWorkerStub(channel)
    stub.Configure(pb.ConfigureRequest(protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=1,
                                       peer_addresses=[address], worker_config_json=CONFIG.to_json(),
                                       run_id="wire-test"), timeout=300)
    yield stub, service
    channel.close()
    server.stop(0)


def _step(stub, step, tokens, **fields):
    return stub.Step(pb.StepRequest(step=step, tokens=codec.encode(tokens), global_tokens=ROWS * (COLS - 1),
                                    run_id="wire-test", **fields), timeout=60)


def test_narrow_batches_are_accepted_and_other_dtypes_refused(worker):
    stub, service = worker
    tokens = np.random.default_rng(0).integers(0, 256, (ROWS, COLS))
    step = service.pod.trainer.step
    # uint16 where the wire codec carries it (protos/codec.py DTYPES).
    for dtype in [d for d in (np.uint8, np.uint16, np.int32) if np.dtype(d).name in codec.DTYPES]:
        reply = _step(stub, step, tokens.astype(dtype))
        assert reply.step == step and reply.checksum
        step += 1
    for dtype in (np.int8, np.uint32, np.int64, np.float32):
        with pytest.raises(grpc.RpcError) as info:
            _step(stub, step, tokens.astype(dtype))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "uint8, uint16 or int32" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:      # an id beyond the vocabulary (256)
        _step(stub, step, np.full((ROWS, COLS), CONFIG.model.vocab_size, np.int32))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in info.value.details()
    assert _step(stub, step, tokens.astype(np.uint8)).step == step     # and the worker trains on


def test_the_fingerprint_comes_only_when_asked(worker):
    stub, service = worker
    tokens = np.random.default_rng(1).integers(0, 256, (ROWS, COLS)).astype(np.uint8)
    step = service.pod.trainer.step
    plain = _step(stub, step, tokens)
    assert plain.fingerprint == "" and plain.timings.exposed_exchange_s >= 0.0
    assert plain.timings.fingerprint_s == 0.0 and plain.timings.checksum_s > 0.0
    full = _step(stub, step + 1, tokens, take_fingerprint=True)
    assert full.fingerprint == service.pod.trainer.fingerprint() != full.checksum
    assert full.checksum == service.pod.trainer.checksum() and full.timings.fingerprint_s > 0.0
    # A checkpoint of that state carries the same fingerprint.
    assert service.pod.trainer.fingerprint() == full.fingerprint
