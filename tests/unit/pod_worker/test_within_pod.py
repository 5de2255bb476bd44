"""Within-pod techniques: sequence parallelism, activation recomputation, microbatching.

Each mode compiles the pod's real gradient program (pod_worker.programs.make_grad_step) on a
simulated 4-device pod; every mode must give the plain layout's loss and gradients, and the
compiled programs' memory/FLOP accounting must move the way the technique promises.
"""
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multipod.model import ConfigError, ModelConfig, abstract_params, init_params, partitioning
from multipod.model.layers import SAVED_BY_SELECTIVE, remat_policy
from multipod.pod_worker import programs

# Long enough sequences that attention scores (T^2) matter next to the other activations.
SEQ = 64
BATCH = 8
BASE = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=64,
                   max_seq_len=SEQ)


class Compiled:
    """One compiled grad step of `config` on a (data, model) mesh, run once on fixed tokens."""

    def __init__(self, config: ModelConfig, data: int, model: int, tokens: np.ndarray, host_params):
        mesh = partitioning.make_mesh(data, model)
        p_shard = partitioning.param_shardings(abstract_params(config), mesh)
        b_shard, rep = partitioning.batch_sharding(mesh), partitioning.replicated(mesh)
        params = jax.device_put(host_params, p_shard)
        with partitioning.activate_rules(mesh):
            step = jax.jit(programs.make_grad_step(config), in_shardings=(p_shard, b_shard, rep),
                           out_shardings=(p_shard, rep, rep))
            self.compiled = step.lower(params, jax.ShapeDtypeStruct(tokens.shape, jnp.int32, sharding=b_shard),
                                       jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)).compile()
        norm = jax.device_put(np.float32(tokens.shape[0] * (tokens.shape[1] - 1)), rep)
        grads, ce, z = self.compiled(params, jax.device_put(tokens, b_shard), norm)
        self.grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
        self.ce, self.z = float(ce), float(z)
        self.memory = programs.memory_stats(self.compiled)
        self.flops = programs.program_flops(self.compiled, config.microbatches)


MODES = {
    "plain": ({}, (2, 2)),
    "sequence_parallel": ({"sequence_parallel": True}, (2, 2)),
    "remat_full": ({"remat": "full"}, (2, 2)),
    "remat_selective": ({"remat": "selective"}, (2, 2)),
    "microbatches_2": ({"microbatches": 2}, (2, 2)),
    "all_together": ({"microbatches": 4, "sequence_parallel": True, "remat": "selective"}, (1, 4)),
}


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, 256, size=(BATCH, SEQ + 1)).astype(np.int32)


@pytest.fixture(scope="module")
def host_params():
    # The switches do not change the parameters: one init serves every mode.
    return jax.tree.map(np.asarray, init_params(BASE, seed=0))


@pytest.fixture(scope="module")
def compiled(tokens, host_params):
    """Every mode compiled and run once, lazily, shared by the tests of this module."""
    cache = {}

    def get(mode):
        if mode not in cache:
            overrides, mesh = MODES[mode]
            cache[mode] = Compiled(dataclasses.replace(BASE, **overrides), *mesh, tokens, host_params)
        return cache[mode]
    return get


@pytest.mark.parametrize("mode", [m for m in MODES if m != "plain"])
def test_mode_matches_plain_loss_and_gradients(compiled, mode):
    got, want = compiled(mode), compiled("plain")
    np.testing.assert_allclose(got.ce, want.ce, rtol=1e-5)
    np.testing.assert_allclose(got.z, want.z, rtol=1e-5)
    assert len(got.grads) == len(want.grads)
    for g, w in zip(got.grads, want.grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def test_sequence_parallel_lowers_compiled_memory(compiled):
    plain, sp = compiled("plain").memory, compiled("sequence_parallel").memory
    assert sp["temp_bytes"] < plain["temp_bytes"]
    assert sp["peak_bytes"] < plain["peak_bytes"]


def test_sequence_parallel_gathers_activations(compiled):
    """XLA emits all-gathers of the sequence-split activations [b/data, T, d] that plain TP lacks."""
    shape = rf"f32\[{BATCH // 2},{SEQ},{BASE.d_model}\]"

    def gathers(mode):
        return len(re.findall(shape + r"\{[^}]*\} all-gather", compiled(mode).compiled.as_text()))
    assert gathers("plain") == 0
    assert gathers("sequence_parallel") >= BASE.n_layers


def test_selective_remat_has_fewer_temporaries_than_none(compiled):
    assert compiled("remat_selective").memory["temp_bytes"] < compiled("plain").memory["temp_bytes"]


def test_full_remat_costs_more_hardware_flops_than_selective(compiled):
    plain, selective, full = (compiled(m).flops for m in ("plain", "remat_selective", "remat_full"))
    assert plain < selective < full


def test_microbatched_flops_count_every_microbatch(compiled):
    # XLA counts the scan body once; program_flops scales it by the trip count.
    plain, micro = compiled("plain").flops, compiled("microbatches_2").flops
    assert micro == pytest.approx(plain, rel=0.05)


def test_microbatched_step_is_bitwise_reproducible(compiled, tokens, host_params):
    """Pods run the same program on the same bytes: a second compile gives identical gradients."""
    again = Compiled(dataclasses.replace(BASE, microbatches=2), 2, 2, tokens, host_params)
    first = compiled("microbatches_2")
    assert again.ce == first.ce
    for a, b in zip(again.grads, first.grads):
        np.testing.assert_array_equal(a, b)


def test_microbatches_must_divide_the_batch():
    config = dataclasses.replace(BASE, microbatches=3)
    step = programs.make_grad_step(config)
    params = nn.unbox(abstract_params(config))
    with pytest.raises(ConfigError, match=r"model.microbatches: 3 does not divide the pod's batch of 8"):
        jax.eval_shape(step, params, jax.ShapeDtypeStruct((8, SEQ + 1), jnp.int32),
                       jax.ShapeDtypeStruct((), jnp.float32))


def test_microbatches_keep_each_devices_rows():
    tokens = jnp.arange(8 * 3).reshape(8, 3)
    micro = programs.split_microbatches(tokens, 2)
    assert micro.shape == (2, 4, 3)
    # Microbatch i takes rows i, i+2, ...: contiguous data shards keep their rows on-device.
    np.testing.assert_array_equal(micro[0][:, 0], [0, 6, 12, 18])
    np.testing.assert_array_equal(micro[1][:, 0], [3, 9, 15, 21])


def test_remat_policies_are_named():
    assert remat_policy("none") is None and remat_policy("full") is None
    assert "attention_context" in SAVED_BY_SELECTIVE and "mlp_out" in SAVED_BY_SELECTIVE
    with pytest.raises(ValueError, match="unknown remat policy"):
        remat_policy("some")


def test_sequence_parallel_rules_map_residual_length_to_model():
    plain = dict(partitioning.logical_rules(BASE))
    sp = dict(partitioning.logical_rules(dataclasses.replace(BASE, sequence_parallel=True)))
    assert plain["residual_length"] is None and sp["residual_length"] == "model"
    assert {k: v for k, v in sp.items() if k != "residual_length"} == \
        {k: v for k, v in plain.items() if k != "residual_length"}


@pytest.mark.parametrize("field, value, message", [
    ("remat", "some", r"model.remat: must be one of none, full, selective, got 'some'"),
    ("sequence_parallel", 1, "model.sequence_parallel: must be true or false"),
    ("microbatches", 0, "model.microbatches: must be positive"),
])
def test_bad_switches_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(BASE, **{field: value}).validate()
