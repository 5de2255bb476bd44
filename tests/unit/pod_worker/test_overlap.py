"""The overlapped gradient step (pod_worker/overlap.py, dcn.overlap): per-layer programs give the
fused step's gradients to float tolerance, on one device and on a 2x2 mesh, with and without
microbatches (summed in microbatch order, bit for bit), and hand the exchange the leaves in
readiness order (the last block first, the embedding last). dcn.overlap = auto overlaps a step big
enough to gain and not prompt tuning, which refuses an explicit true."""
import dataclasses

import jax
import numpy as np
import pytest

from multipod.model import ConfigError
from multipod.pod_worker.schema import DcnConfig, MeshConfig
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config


def _config(mesh=(1, 1), overlap=True, **model):
    base = tiny_worker_config()
    return dataclasses.replace(base, mesh=MeshConfig(data=mesh[0], model=mesh[1]),
                               dcn=DcnConfig(overlap=overlap),
                               model=dataclasses.replace(base.model, **model)).validate()


def _tokens(seed=0, rows=4, length=33):
    return np.random.default_rng(seed).integers(0, 256, (rows, length)).astype(np.int32)


def _part_names(trainer):
    """The top-level parameter name ("block_0", "embedding", ...) of each flattened leaf."""
    return [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(trainer.params)[0]]


@pytest.mark.parametrize("mesh,model", [
    ((1, 1), {}),
    ((2, 2), {}),
    ((2, 2), {"sequence_parallel": True, "remat": "selective"}),
    ((1, 1), {"remat": "full"}),
    ((1, 1), {"microbatches": 4}),
    ((2, 2), {"microbatches": 2}),
])
def test_overlapped_gradients_equal_the_fused_gradients(mesh, model):
    trainer = PodTrainer(_config(mesh, **model), jax.devices()[: mesh[0] * mesh[1]])
    batch = trainer.put_batch(_tokens())
    fused, ce, z = trainer.gradients(batch, global_tokens=4 * 32)
    norm = jax.device_put(np.float32(4 * 32), trainer.scalar_sharding)
    launched = trainer._overlapped.launch(trainer.params, batch, norm)
    assert float(launched.ce) == pytest.approx(ce, rel=1e-5)
    assert float(launched.z) == pytest.approx(z, rel=1e-5)
    assert len(launched.leaves) == len(fused)
    for name, want, got, sharding in zip(_part_names(trainer), fused, launched.leaves,
                                         jax.tree.leaves(trainer.param_sharding)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert got.sharding.is_equivalent_to(sharding, got.ndim), name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-7, err_msg=name)
    assert any(np.abs(np.asarray(leaf)).max() > 0 for leaf in launched.leaves)


def test_leaves_are_handed_to_the_exchange_in_readiness_order():
    trainer = PodTrainer(_config(n_layers=3), jax.devices()[:1])
    calls = []

    def all_reduce(leaves, order=None):
        # Take each leaf in the given order (as the exchange does), blocking on it only then.
        calls.append((list(order), [np.asarray(leaves[i]).copy() for i in order]))
        return leaves, None

    outcome = trainer.train_step(trainer.put_batch(_tokens()), 4 * 32, all_reduce)
    (order, taken), = calls
    assert sorted(order) == list(range(len(jax.tree.leaves(trainer.params))))
    names = _part_names(trainer)
    parts = []
    for i in order:       # the parts in the order their leaves were handed over, without repeats
        if not parts or parts[-1] != names[i]:
            parts.append(names[i])
    assert parts == ["final_norm", "block_2", "block_1", "block_0", "embedding"]
    assert all(np.isfinite(t).all() for t in taken)
    assert outcome.exposed_exchange_s >= 0.0 and outcome.compute_s > 0.0


def test_the_warm_up_compiles_the_per_layer_programs_and_leaves_the_state_as_it_was():
    """Pod._build runs warm_up at configure, so the first step and evaluation do not compile
    (where every pod would compile the same programs at once); the state and the step stay as
    they were, and the first step then trains exactly as on a trainer without the warm-up."""
    warmed, cold = (PodTrainer(_config(), jax.devices()[:1]) for _ in range(2))
    before = (warmed.checksum(), warmed.fingerprint(), warmed.step)
    warmed.warm_up((4, 33))
    assert (warmed.checksum(), warmed.fingerprint(), warmed.step) == before
    programs = [p for p in vars(warmed._overlapped).values() if hasattr(p, "_cache_size")]
    sizes = [p._cache_size() for p in programs]
    assert len(programs) == 7 and all(sizes), sizes
    # (jax's cache of a program is shared by every trainer of the same model in this process, so
    # the evaluation's is judged by what the first evaluation adds to it: nothing.)
    evaluated = warmed._eval_step._cache_size()
    assert evaluated >= 1
    warmed.evaluate(_tokens())
    assert warmed._eval_step._cache_size() == evaluated
    losses = [t.train_step(t.put_batch(_tokens()), 4 * 32).loss_sum for t in (warmed, cold)]
    assert [p._cache_size() for p in programs] == sizes     # the first step compiled nothing new
    assert losses[0] == losses[1] and warmed.checksum() == cold.checksum()
    fused = PodTrainer(_config(overlap=False), jax.devices()[:1])
    ran = _count_calls(fused, "_eval_step")
    fused.warm_up((4, 33))      # the fused step has no per-layer programs: only the evaluation
    assert fused._overlapped is None and fused.step == 0 and ran == [1]
    # A run that does not evaluate (ConfigureRequest.evaluates) leaves the evaluation alone; an
    # evaluation asked for anyway runs it then, with the same result.
    bare = PodTrainer(_config(overlap=False), jax.devices()[:1])
    ran = _count_calls(bare, "_eval_step")
    bare.warm_up((4, 33), evaluate=False)
    assert ran == [0]
    assert bare.evaluate(_tokens()) == fused.evaluate(_tokens()) and ran == [1]


def _count_calls(trainer, name: str) -> list[int]:
    """Count the calls of trainer.<name> from now on (a list of one count, updated in place)."""
    program, count = getattr(trainer, name), [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return program(*args, **kwargs)
    setattr(trainer, name, counted)
    return count


def test_overlap_on_and_off_train_alike():
    """Three steps of train_step with an identity exchange: same losses and parameters."""
    runs = {}
    for overlap in (False, True):
        trainer = PodTrainer(_config(overlap=overlap), jax.devices()[:1])
        losses = [trainer.train_step(trainer.put_batch(_tokens(seed=s)), 4 * 32).loss_sum for s in range(3)]
        runs[overlap] = losses, trainer.params
    (off_losses, off_params), (on_losses, on_params) = runs[False], runs[True]
    np.testing.assert_allclose(on_losses, off_losses, rtol=1e-5)
    assert on_losses[-1] != on_losses[0]
    for a, b in zip(jax.tree.leaves(on_params), jax.tree.leaves(off_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


def test_microbatches_sum_in_microbatch_order_in_float32():
    """With M microbatches the overlapped gradient is, bit for bit, the float32 sum in order
    0, 1, ..., M-1 of each microbatch's gradient from the same programs run on it alone (what
    issue 21's split of a shard over several pods must reassemble); the loss sums likewise."""
    k = 4
    whole = PodTrainer(_config(microbatches=k), jax.devices()[:1])
    alone = PodTrainer(_config(microbatches=1), jax.devices()[:1])
    tokens = _tokens(rows=8)
    norm = jax.device_put(np.float32(8 * 32), whole.scalar_sharding)
    launched = whole._overlapped.launch(whole.params, whole.put_batch(tokens), norm)
    parts = [alone._overlapped.launch(alone.params, alone.put_batch(tokens[m::k]), norm) for m in range(k)]
    for index, got in enumerate(launched.leaves):
        total = np.asarray(parts[0].leaves[index], np.float32)
        for part in parts[1:]:
            total = total + np.asarray(part.leaves[index], np.float32)
        assert np.asarray(got).tobytes() == total.tobytes(), index
    for name in ("ce", "z"):
        total = np.float32(getattr(parts[0], name))
        for part in parts[1:]:
            total = np.float32(total + np.float32(getattr(part, name)))
        assert np.float32(getattr(launched, name)) == total, name


def test_auto_overlaps_where_the_layout_can_and_the_step_is_big_enough():
    from multipod.pod_worker.schema import AUTO_MIN_ACTIVATIONS, Overlap, resolve_overlap
    auto = tiny_worker_config()     # 32 tokens x d_model 32 per row: 64 rows reach 2^16 activations
    assert auto.dcn.overlap is Overlap.AUTO and AUTO_MIN_ACTIVATIONS == 64 * 32 * 32
    assert resolve_overlap(auto, 64) == (True, "")
    overlapped, why = resolve_overlap(auto, 63)
    assert not overlapped and "63 rows x 32 tokens x d_model 32 = 64512 activations per microbatch, under 65536" in why
    halves = dataclasses.replace(auto, model=dataclasses.replace(auto.model, microbatches=2))
    assert resolve_overlap(halves, 128)[0] and not resolve_overlap(halves, 64)[0]     # counted per microbatch
    assert resolve_overlap(dataclasses.replace(auto, dcn=DcnConfig(overlap=True)), 4) == (True, "")
    assert resolve_overlap(dataclasses.replace(auto, dcn=DcnConfig(overlap=False)), 1024)[0] is False
    # The trainer chooses for its pod's shard when it compiles for it (Pod.configure does).
    trainer = PodTrainer(auto, jax.devices()[:1])
    assert trainer._choose_step(64) and trainer._overlapped is not None
    assert not trainer._choose_step(4) and trainer._overlapped is None


def test_explicit_overlap_is_refused_for_prompt_tuning_and_auto_falls_back():
    from multipod.pod_worker.schema import PromptConfig, resolve_overlap
    prompt = PromptConfig(kind="prompt", virtual_tokens=4, base_checkpoint="/somewhere")
    base = tiny_worker_config()
    base = dataclasses.replace(base, prompt=prompt, train=dataclasses.replace(base.train, seq_len=16))
    with pytest.raises(ConfigError, match="dcn.overlap: prompt tuning runs the fused step"):
        dataclasses.replace(base, dcn=DcnConfig(overlap=True)).validate()
    assert resolve_overlap(base.validate(), 4096) == (False, "prompt tuning runs the fused step (its gradient "
                                                             "is a few kilobytes)")
