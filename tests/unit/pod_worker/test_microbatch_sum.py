"""The fixed-order microbatch sum (pod_worker/accumulate.py): a shard's gradient assembled from
pieces computed by another trainer, the partial sums passed between them as host bytes (as the
data plane carries them), is bitwise the gradient the step computes for the whole shard; for the
fused step and dcn.overlap's per-layer programs. Also: the sum starts from microbatch 0's
gradient, never from zeros (a -0.0 keeps its sign), and it refuses to start anywhere else."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multipod.model.partitioning import make_mesh
from multipod.pod_worker.accumulate import MicrobatchSum
from multipod.pod_worker.schema import DcnConfig, MeshConfig
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config

MICROBATCHES = 4
ROWS, COLS = 8, tiny_worker_config().train.seq_len + 1
GLOBAL_TOKENS = 2 * ROWS * (COLS - 1)


def _config(overlap: bool):
    base = tiny_worker_config()
    return dataclasses.replace(
        base, mesh=MeshConfig(data=2, model=1),
        model=dataclasses.replace(base.model, microbatches=MICROBATCHES),
        train=dataclasses.replace(base.train, global_batch=2 * ROWS),
        dcn=DcnConfig(overlap=overlap)).validate()


def _host(tree) -> list[np.ndarray]:
    return [np.array(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
def test_pieces_from_other_trainers_sum_to_the_step_gradient_bitwise(overlap):
    config = _config(overlap)
    devices = jax.devices()
    # Two trainers in the same (initial) state: one the healthy pod, one the pods computing a failed
    # pod's microbatches. On the same devices (one after the other in this thread: no two programs
    # with collectives at once), so the helper loads the healthy one's programs; the partial sums
    # still cross between them as host bytes.
    healthy, helper = PodTrainer(config, devices[:2]), PodTrainer(config, devices[:2])
    assert (healthy._overlapped is not None) == overlap
    tokens = np.random.default_rng(7).integers(0, 256, (ROWS, COLS), dtype=np.int32)

    leaves, ce, z = healthy.gradients(healthy.put_batch(tokens), GLOBAL_TOKENS, to_host=False)
    want = [np.array(leaf) for leaf in leaves]
    assert any(np.abs(leaf).max() > 0 for leaf in want)

    norm = helper._normalizer(GLOBAL_TOKENS)
    shard = helper.put_batch(tokens)
    # A chain over three "pods": microbatches [0, 1) on the helper, [1, 3) on the healthy trainer,
    # [3, 4) on the helper again; every partial sum crosses as host float32 bytes.
    partial, ce_a, _ = helper.microbatches(shard, norm, 0, 1)
    sent = _host(partial)
    assert all(leaf.dtype == np.float32 for leaf in sent)
    partial, ce_b, _ = healthy.microbatches(healthy.put_batch(tokens), healthy._normalizer(GLOBAL_TOKENS), 1, 3,
                                            healthy.put_partial(sent))
    got, ce_c, _ = helper.microbatches(shard, norm, 3, MICROBATCHES, helper.put_partial(_host(partial)))
    got = _host(got)
    assert [leaf.dtype for leaf in got] == [leaf.dtype for leaf in want]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.tobytes() == b.tobytes(), f"leaf {i} differs in its bits"
    assert float(ce_a) + float(ce_b) + float(ce_c) == pytest.approx(ce, rel=1e-6)

    # One microbatch alone, on one trainer, is the whole shard too.
    whole, _, _ = helper.microbatches(shard, norm, 0, MICROBATCHES)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_host(whole), want))


def test_the_sum_starts_from_the_first_gradient_not_from_zeros():
    summer = MicrobatchSum(dataclasses.replace(tiny_worker_config().model, microbatches=2), make_mesh(1, 1))
    g0 = {"w": jnp.array([-0.0, 1.0], jnp.float32)}
    g1 = {"w": jnp.array([-0.0, 2.0], jnp.float32)}
    total = summer.fold(summer.fold(None, g0, 0), g1, 1)
    assert np.signbit(np.array(total["w"])[0])        # -0.0 + -0.0 = -0.0; 0.0 + -0.0 would be +0.0
    with pytest.raises(ValueError, match="starts at microbatch 0"):
        summer.fold(None, g1, 1)
    with pytest.raises(ValueError, match="starts at microbatch 0"):
        summer.fold(g0, g1, 0)
    with pytest.raises(ValueError, match="microbatch 2 of 2"):
        summer.fold(g0, g1, 2)
