"""Generation on a pod (pod_worker/generation.py, the Generate and GenerateStream RPCs): sharded
over the model axis it gives the unsharded tokens; the stream yields one chunk per position and
equals Generate; bad requests are refused with INVALID_ARGUMENT while the worker keeps serving."""
from __future__ import annotations

import math
import re

import grpc
import jax
import numpy as np
import pytest

from multipod.model import ModelConfig, Sampling, abstract_params, init_params
from multipod.model.decode import decoder
from multipod.model.partitioning import make_mesh, param_shardings
from multipod.pod_worker.generation import MAX_PROMPTS, Generator
from multipod.protos import codec, multipod_pb2 as pb
from tests.helpers import tiny_worker_config
from tests.unit.pod_worker.in_process_worker import InProcessWorker, module_worker

MODEL = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=64, max_seq_len=16)
PROMPTS = [np.random.RandomState(s).randint(0, 256, size=n).astype(np.int32) for s, n in ((1, 5), (2, 2), (3, 9))]


@pytest.fixture(scope="module")
def sharp_params():
    # Block weights scaled up so attention and the MLP, not only the tied embedding, decide the
    # next token, with clear margins between the best two logits.
    def scale(path, x):
        return x * 20 if jax.tree_util.keystr(path).startswith("['block_") and x.ndim > 1 else x
    return jax.tree_util.tree_map_with_path(scale, init_params(MODEL, seed=0))


@pytest.mark.parametrize("data, model", [(1, 2), (2, 2)])
def test_sharded_generation_gives_the_unsharded_tokens(sharp_params, data, model):
    mesh = make_mesh(data, model)
    generator = Generator(MODEL, mesh, param_shardings(abstract_params(MODEL), mesh))
    params = generator.put_params(sharp_params)
    assert params["block_0"]["attn"]["query"].sharding.spec[1] == "model"     # heads split as in training
    reference = decoder(MODEL).generate(sharp_params, PROMPTS, 7)
    for got, want in zip(generator.generate(params, PROMPTS, 7), reference):
        np.testing.assert_array_equal(got, want)
    hot = Sampling(temperature=0.8, top_k=20, seed=4)
    reference = decoder(MODEL).generate(sharp_params, PROMPTS, 7, hot)
    for got, want in zip(generator.generate(params, PROMPTS, 7, hot), reference):
        np.testing.assert_array_equal(got, want)


def test_the_cache_is_split_over_the_data_axis(sharp_params):
    mesh = make_mesh(2, 2)
    generator = Generator(MODEL, mesh, param_shardings(abstract_params(MODEL), mesh))
    cache = generator.run("init_cache", np.zeros(4, np.int32))
    assert cache[0]["key"].shape == (4, MODEL.max_seq_len, MODEL.n_kv_heads, MODEL.head_dim)
    assert tuple(cache[0]["key"].sharding.spec)[:1] == ("data",)


# -- through the gRPC adapter ------------------------------------------------------------------
CONFIG = tiny_worker_config()
VOCAB = CONFIG.model.vocab_size


worker = module_worker(lambda: InProcessWorker(CONFIG, "generation-test"))


def _request(prompts=None, prompt=None, **fields) -> pb.GenerateRequest:
    fields.setdefault("num_tokens", 6)
    return pb.GenerateRequest(prompt=codec.encode(prompt) if prompt is not None else b"",
                              prompts=[codec.encode(p) for p in prompts or []], **fields)


def test_the_stream_yields_one_chunk_per_position_and_equals_generate(worker):
    prompts = [np.array([100, 101, 32], np.uint8), np.array([7], np.int32), np.arange(20, dtype=np.int32)]
    for fields in ({}, {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 3}):
        chunks = list(worker.stub.GenerateStream(_request(prompts, **fields), timeout=120))
        assert [c.index for c in chunks] == list(range(6))
        streamed = np.stack([codec.decode(c.tokens) for c in chunks], axis=1)
        assert all(list(c.rows) == [0, 1, 2] for c in chunks)
        reply = worker.stub.Generate(_request(prompts, **fields), timeout=120)
        np.testing.assert_array_equal(codec.decode(reply.tokens), streamed)
        assert list(reply.lengths) == [6, 6, 6]
    # The one-prompt form answers a 1-d array, the first row's completion of the batch above.
    single = worker.stub.Generate(_request(prompt=prompts[0]), timeout=120)
    np.testing.assert_array_equal(codec.decode(single.tokens), codec.decode(
        worker.stub.Generate(_request(prompts), timeout=120).tokens)[0])


def test_a_row_ends_at_its_end_token(worker):
    prompt = np.array([100, 101, 32], np.uint8)
    greedy = codec.decode(worker.stub.Generate(_request(prompt=prompt), timeout=120).tokens)
    eos = int(greedy[2])
    ended = codec.decode(worker.stub.Generate(_request(prompt=prompt, eos_id=eos), timeout=120).tokens)
    first = int(np.flatnonzero(greedy == eos)[0])
    np.testing.assert_array_equal(ended, greedy[:first + 1])
    chunks = list(worker.stub.GenerateStream(_request([prompt, prompt], eos_id=eos), timeout=120))
    assert len(chunks) == first + 1       # every row ended: the stream ends


def test_a_cancelled_stream_stops_and_the_worker_keeps_serving(worker):
    stream = worker.stub.GenerateStream(_request(prompt=np.array([1, 2], np.uint8), num_tokens=25), timeout=120)
    assert next(stream).index == 0
    stream.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert len(codec.decode(worker.stub.Generate(_request(prompt=np.array([1], np.uint8)), timeout=60).tokens)) == 6


BAD = {
    "no prompt": (_request(), "exactly one of prompt"),
    "both forms": (_request([np.array([1], np.uint8)], prompt=np.array([1], np.uint8)), "exactly one of prompt"),
    "an empty prompt": (_request(prompt=np.zeros(0, np.uint8)), "empty"),
    "an empty prompt in a batch": (_request([np.array([1], np.uint8), np.zeros(0, np.uint8)]), "prompt 1 is empty"),
    "a 2-d prompt": (_request(prompt=np.zeros((2, 2), np.uint8)), "1-d"),
    "a float prompt": (_request(prompt=np.zeros(3, np.float32)), "uint8, uint16 or int32"),
    "an id out of range": (_request(prompt=np.array([1, VOCAB], np.int32)), rf"\[0, {VOCAB}\)"),
    "a negative id": (_request(prompt=np.array([-1], np.int32)), rf"\[0, {VOCAB}\)"),
    "a prompt beyond max_seq_len": (_request(prompt=np.zeros(33, np.uint8)),
                                    "33 tokens, more than the model's context of 32"),
    "prompt + num_tokens beyond max_seq_len": (_request(prompt=np.zeros(30, np.uint8), num_tokens=5),
                                               "exceed the model's context of 32 tokens .* at most 2 new tokens"),
    "no new tokens": (_request(prompt=np.zeros(3, np.uint8), num_tokens=0), "num_tokens"),
    "too many new tokens": (_request(prompt=np.zeros(3, np.uint8), num_tokens=5000, shift_context=True), "num_tokens"),
    "top_p 0": (_request(prompt=np.zeros(3, np.uint8), top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_p above 1": (_request(prompt=np.zeros(3, np.uint8), top_p=1.5), r"top_p must be in \(0, 1\]"),
    "top_p nan": (_request(prompt=np.zeros(3, np.uint8), top_p=math.nan), "top_p"),
    "a negative temperature": (_request(prompt=np.zeros(3, np.uint8), temperature=-1.0), "temperature"),
    "an infinite temperature": (_request(prompt=np.zeros(3, np.uint8), temperature=math.inf), "temperature"),
    "an eos id out of range": (_request(prompt=np.zeros(3, np.uint8), eos_id=VOCAB), f"eos_id {VOCAB}"),
    "too many prompts": (_request([np.array([1], np.uint8)] * (MAX_PROMPTS + 1)), "at most"),
    "a prompt that is not a codec array": (pb.GenerateRequest(prompt=b"\x93garbage", num_tokens=3), ""),
}


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_are_refused_and_the_worker_keeps_serving(worker, method, case):
    request, match = BAD[case]
    with pytest.raises(grpc.RpcError) as info:
        reply = getattr(worker.stub, method)(request, timeout=60)
        if method == "GenerateStream":
            list(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert re.search(match, info.value.details()), info.value.details()
    assert len(codec.decode(worker.stub.Generate(_request(prompt=np.array([1], np.uint8)), timeout=60).tokens)) == 6


def _configure_generation_only(target: InProcessWorker) -> pb.ConfigureReply:
    from multipod import protos
    return target.stub.Configure(pb.ConfigureRequest(
        protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=1, peer_addresses=[target.address],
        worker_config_json=CONFIG.to_json(), run_id="generation-only", generation_only=True, awaits_state=True),
        timeout=300)


def _step(target: InProcessWorker) -> pb.StepReply:
    rows, cols = CONFIG.train.global_batch, CONFIG.train.seq_len + 1
    tokens = np.random.default_rng(5).integers(0, VOCAB, (rows, cols), dtype=np.int32)
    return target.stub.Step(pb.StepRequest(step=0, tokens=codec.encode(tokens), global_tokens=rows * (cols - 1),
                                           run_id=target.pod.setup().run_id), timeout=120)


def test_a_pod_configured_to_generate_only_builds_nothing_a_restore_replaces_and_then_works_alike(
        tmp_path, monkeypatch):
    # `multipod generate`'s pods (ConfigureRequest.generation_only and awaits_state): the step's
    # programs are not compiled at configure, and no initial state is built (the init program
    # neither compiled nor run, the state never held twice): the first Restore gives the pod its
    # state. Until then what
    # needs a state is refused, naming why; after it, generation and a step are the same as on a
    # pod configured to train that restored the same checkpoint.
    from multipod.pod_worker import trainer_state as trainer_module
    trains = InProcessWorker(CONFIG, "trains")
    initialised = []
    real_init = trainer_module.init_params
    monkeypatch.setattr(trainer_module, "init_params", lambda *a, **k: initialised.append(a) or real_init(*a, **k))
    generates = InProcessWorker(CONFIG, "generates")
    try:
        initialised.clear()         # the fixture configured it to train first, as any pod starts
        reply = _configure_generation_only(generates)
        trainer = generates.pod.setup().trainer
        assert not initialised and not trainer.has_state and not trainer.step_compiled
        assert trains.pod.setup().trainer.step_compiled
        assert reply.memory_peak_bytes == 0 and reply.hardware_flops_per_step == 0 and reply.fingerprint == ""
        request = _request([np.array([100, 101, 32], np.uint8), np.array([7], np.int32)], temperature=0.9, seed=3)
        for refused in (lambda: generates.stub.Generate(request, timeout=60), lambda: _step(generates),
                        lambda: generates.stub.Save(pb.SaveRequest(step=0, directory=str(tmp_path / "no")),
                                                    timeout=60)):
            with pytest.raises(grpc.RpcError) as info:
                refused()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
            assert "first Restore" in info.value.details()
        assert generates.stub.Status(pb.StatusRequest(), timeout=10).state == pb.WORKER_STATE_READY

        saved = trains.stub.Save(pb.SaveRequest(step=0, directory=str(tmp_path / "ckpt")), timeout=120)
        for target in (trains, generates):
            restored = target.stub.Restore(pb.RestoreRequest(directory=str(tmp_path / "ckpt"), run_id="restored"),
                                           timeout=120)
            assert restored.fingerprint == saved.fingerprint
        assert not initialised and trainer.has_state
        assert generates.stub.Generate(request, timeout=120).tokens == trains.stub.Generate(request, timeout=120).tokens
        stepped, compiled = _step(generates), _step(trains)
        assert (stepped.checksum, stepped.loss_sum) == (compiled.checksum, compiled.loss_sum)
    finally:
        trains.close()
        generates.close()
