"""Generation on a pod of several hosts, the parts that can be checked in one process: the
programs take host arrays replicated and give the next tokens whole on every device (jax refuses
a host array split over several processes' devices, and a host cannot read rows another holds);
and a Pod laid out as host 0 of 2 (its meeting with the other host replaced by a recorder) holds
the pod for the whole stream, meets the other host once before it, and runs it to its end when
the caller leaves (the other host's programs wait for this one's). tests/e2e/test_hosts.py
runs it on real pods of two hosts."""
from __future__ import annotations

import numpy as np
import pytest

from multipod.model import ModelConfig, Sampling, abstract_params, init_params
from multipod.model.partitioning import make_mesh, param_shardings
from multipod.pod_worker import pod as pod_module
from multipod.pod_worker.errors import Busy
from multipod.pod_worker.generation import Generator
from multipod.pod_worker.hosts import HostLayout
from multipod.pod_worker.pod import Pod
from tests.helpers import tiny_worker_config

MODEL = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=64, max_seq_len=16)
PROMPTS = [np.array([5, 6, 7], np.int32), np.array([9], np.int32)]


def test_host_inputs_and_the_next_tokens_are_replicated_and_the_cache_split():
    mesh = make_mesh(2, 2)
    generator = Generator(MODEL, mesh, param_shardings(abstract_params(MODEL), mesh))
    params = generator.put_params(init_params(MODEL, seed=0))
    for name in ("prefill", "decode"):
        program = generator._programs[name]
        lengths = np.array([3, 1], np.int32)
        tokens = np.zeros((2, 8), np.int32) if name == "prefill" else lengths
        compiled = program.lower(params, generator.run("init_cache", lengths), tokens, lengths, lengths,
                                 np.zeros(2, np.uint32), np.int32(0), np.float32(0), np.int32(0),
                                 np.float32(1)).compile()
        inputs = compiled.input_shardings[0][2:]
        assert all(s.is_fully_replicated for s in inputs), name
        next_tokens, cache, _ = compiled.output_shardings
        assert next_tokens.is_fully_replicated, name
        assert tuple(cache[0]["key"].spec)[:1] == ("data",), name


@pytest.fixture(scope="module")
def two_host_pod():
    """Host 0 of a pod of 2 hosts, alone in this process (its 4 devices stand for the pod's)."""
    pod = Pod(0, None, HostLayout(host_index=0, hosts_per_pod=2, coordinator="127.0.0.1:1"))
    pod.configure(tiny_worker_config(), 1, [""], "run-a")
    yield pod
    pod.close()


@pytest.fixture
def meetings(monkeypatch):
    names = []
    monkeypatch.setattr(pod_module, "meet", lambda name, timeout_s, what="step": names.append((name, what)))
    return names


def _count_programs(monkeypatch, generator) -> list[str]:
    calls, run = [], generator.run
    monkeypatch.setattr(generator, "run", lambda name, *args: calls.append(name) or run(name, *args))
    return calls


def test_the_pod_is_held_for_the_whole_stream_which_runs_to_its_end_when_the_caller_leaves(
        two_host_pod, meetings, monkeypatch):
    pod = two_host_pod
    calls = _count_programs(monkeypatch, pod.trainer.generator)
    stream = pod.generate_stream(PROMPTS, 6, Sampling(temperature=0.5, seed=1), deadline=1e18)
    first = next(stream)
    assert first.index == 0 and list(first.rows) == [0, 1]
    assert meetings == [(f"run-a/{pod.setup().epoch}/0/generate", "generation")]
    with pytest.raises(Busy, match="a generation is still running"), pod.seq.hold("a probe", deadline=0.0):
        pass
    stream.close()      # the caller left after the first token
    assert calls.count("decode") == 5       # every later position was computed all the same
    with pod.seq.hold("a probe", deadline=0.0):     # and the pod is free again
        pass


def test_a_generation_the_other_host_never_starts_is_refused_and_frees_the_pod(two_host_pod, monkeypatch):
    def alone(name, timeout_s, what="step"):
        raise TimeoutError(f"the pod's other host(s) did not start the same {what} within {timeout_s:.1f}s")
    monkeypatch.setattr(pod_module, "meet", alone)
    stream = two_host_pod.generate_stream(PROMPTS, 4, Sampling(), deadline=1e18)
    with pytest.raises(Busy, match="pod 0 host 0: the pod's other host.* same generation"):
        next(stream)
    with two_host_pod.seq.hold("a probe", deadline=0.0):
        pass
