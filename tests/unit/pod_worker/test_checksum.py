"""The per-step state checksum (programs.state_checksum, computed on the devices) and what the
fused step leaves on the host: the checksum changes with any single bit of any leaf of the
parameters and optimizer state, does not depend on the sharding, and is what a step reports; the
fingerprint (BLAKE2b) comes only when asked for; narrow token batches train exactly like int32 ones."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multipod.pod_worker import programs
from multipod.pod_worker.schema import MeshConfig
from multipod.pod_worker.trainer import PodTrainer, fingerprint
from tests.helpers import tiny_worker_config

GLOBAL_TOKENS = 4 * 32


def _trainer(mesh=(1, 1)) -> PodTrainer:
    config = dataclasses.replace(tiny_worker_config(), mesh=MeshConfig(data=mesh[0], model=mesh[1])).validate()
    return PodTrainer(config, jax.devices()[: mesh[0] * mesh[1]])


def _tokens(seed=0, rows=4, length=33) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, length)).astype(np.int32)


def _checksum(*trees) -> str:
    return programs.checksum_hex(np.asarray(jax.jit(programs.state_checksum)(*trees)))


@pytest.fixture(scope="module")
def trained():
    """A tiny trainer after two steps (Adam moments and count non-zero), as host trees."""
    trainer = _trainer()
    for seed in range(2):
        trainer.train_step(trainer.put_batch(_tokens(seed)), GLOBAL_TOKENS)
    state = trainer.host_state()
    return trainer, state["params"], state["opt_state"]


def _flip(tree, leaf_index: int, element: int, bit: int):
    """A copy of `tree` with one bit of one element of one leaf flipped."""
    leaves, treedef = jax.tree.flatten(tree)
    leaf = np.array(leaves[leaf_index], copy=True)
    words = leaf.reshape(-1).view(np.dtype(f"u{leaf.dtype.itemsize}"))
    words[element] ^= words.dtype.type(1 << bit)
    leaves[leaf_index] = leaf
    return jax.tree.unflatten(treedef, leaves)


def test_a_flipped_bit_in_any_leaf_changes_the_checksum(trained):
    _, params, opt_state = trained
    base = _checksum(params, opt_state)
    assert base == _checksum(params, opt_state)               # deterministic
    state = (params, opt_state)
    leaves = jax.tree.leaves(state)
    assert any(np.ndim(leaf) == 0 for leaf in leaves)         # the optimizer's count is covered too
    seen = {base}
    for index, leaf in enumerate(leaves):
        size, width = max(1, np.size(leaf)), np.dtype(leaf.dtype).itemsize * 8
        for element, bit in ((0, 0), (size - 1, width - 1), (size // 2, width // 2)):
            changed = _checksum(*_flip(state, index, element, bit))
            assert changed != base, f"leaf {index} {np.shape(leaf)}: bit {bit} of element {element} not seen"
            seen.add(changed)
    assert len(seen) == 1 + 3 * len(leaves)                   # and every change gives its own value


def test_swapped_or_shifted_values_change_the_checksum(trained):
    _, params, _ = trained
    leaves, treedef = jax.tree.flatten(params)
    index = max(range(len(leaves)), key=lambda i: np.size(leaves[i]))
    base = _checksum(params)
    flat = np.asarray(leaves[index]).reshape(-1)
    swapped, shifted = flat.copy(), np.roll(flat, 1)
    swapped[[0, 1]] = swapped[[1, 0]]
    for variant in (swapped, shifted):
        other = list(leaves)
        other[index] = variant.reshape(np.shape(leaves[index]))
        assert _checksum(jax.tree.unflatten(treedef, other)) != base
    # The same leaves in another order, or in other shapes, are another state.
    assert _checksum(params, params) != _checksum(params)
    reshaped = list(leaves)
    reshaped[index] = flat.reshape(-1, 1)
    assert _checksum(jax.tree.unflatten(treedef, reshaped)) != base


def test_the_checksum_does_not_depend_on_the_sharding(trained):
    one, params, opt_state = trained
    sharded = _trainer(mesh=(2, 2))
    assert sharded.mesh_shape == (2, 2)
    sharded.load_state(params, opt_state, one.step)
    one.load_state(params, opt_state, one.step)
    # Some leaves really are split over the model axis.
    assert any(len(leaf.sharding.device_set) > 1 and not leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(sharded.params))
    assert sharded.checksum() == one.checksum() == _checksum(params, opt_state)


def test_on_a_model_parallel_mesh_each_device_sums_its_own_shards(trained):
    """The per-step checksum moves no leaf between devices: only each leaf's partial sums are
    all-reduced. (Flattening a leaf split over the model axis made XLA all-gather it, so every step
    copied every tensor-parallel leaf of the state onto every device.)"""
    _, params, opt_state = trained
    sharded = _trainer(mesh=(1, 2))
    sharded.load_state(params, opt_state, 2)
    program = sharded._checksum.lower(sharded.params, sharded.opt_state).compile().as_text()
    assert "all-reduce" in program            # the leaves split over the model axis are summed across it
    for moves in ("all-gather", "all-to-all", "collective-permute"):
        assert f"{moves}(" not in program, moves
    assert sharded.checksum() == _checksum(params, opt_state)


def _numpy_checksum(*trees) -> str:
    """The checksum's formula (programs.py's comment) restated in NumPy, one leaf after another."""
    def mix(h, mul1=0x85EBCA6B, mul2=0xC2B2AE35):
        h = np.uint32((int(h) ^ (int(h) >> 16)) * mul1 & 0xFFFFFFFF)
        h = np.uint32((int(h) ^ (int(h) >> 13)) * mul2 & 0xFFFFFFFF)
        return int(h) ^ (int(h) >> 16)
    acc = [0x6A09E667, 0xBB67AE85]
    for index, leaf in enumerate(jax.tree.leaves(trees)):
        leaf = np.asarray(leaf)
        bits = leaf.reshape(-1).view(f"u{leaf.dtype.itemsize}").astype(np.uint64)
        salt = programs._leaf_salt(index, leaf)
        pos = np.arange(bits.size, dtype=np.uint64)
        weight = ((pos * programs._POS_MUL + ((programs._POS_ADD ^ salt) & 0xFFFFFFFF)) & 0xFFFFFFFF) | 1
        terms = ((bits ^ (bits >> 15)) * weight) & 0xFFFFFFFF
        total = (int(terms.sum()) & 0xFFFFFFFF) ^ salt
        acc[0] = mix((acc[0] * 0x01000193 + total) & 0xFFFFFFFF)
        acc[1] = mix((acc[1] * 0x2545F491 + (total ^ 0x5BD1E995)) & 0xFFFFFFFF, 0x7FEB352D, 0x846CA68B)
    return "".join(f"{w:08x}" for w in acc)


def test_the_checksum_is_its_formula(trained):
    """The program computes the documented formula exactly: for the trained state (a folded big
    leaf, small ones, the optimizer's int32 count) and for narrow, boolean and odd-sized leaves."""
    _, params, opt_state = trained
    rng = np.random.default_rng(7)
    odd = {"big": rng.standard_normal(8 * 1024 * 3 + 5).astype(np.float32),
           "narrow": rng.integers(0, 256, (3, 7)).astype(np.uint8),
           "half": rng.standard_normal((5, 3)).astype(jnp.bfloat16),
           "flags": rng.integers(0, 2, 9).astype(bool), "empty": np.zeros((0, 4), np.float32),
           "count": np.int32(-3)}
    assert max(np.size(leaf) for leaf in jax.tree.leaves(params)) >= 8 * 1024     # the fold is covered
    for trees in ((params, opt_state), (odd,), ()):
        assert _checksum(*trees) == _numpy_checksum(*trees)


def test_a_step_reports_the_checksum_and_the_fingerprint_only_when_asked():
    trainer = _trainer()
    batch = trainer.put_batch(_tokens())
    plain = trainer.train_step(batch, GLOBAL_TOKENS)
    assert plain.checksum == trainer.checksum() and plain.fingerprint == ""
    assert plain.exposed_exchange_s >= 0.0 and plain.checksum_s >= 0.0 and plain.fingerprint_s == 0.0
    full = trainer.train_step(batch, GLOBAL_TOKENS, take_fingerprint=True)
    assert full.checksum == trainer.checksum() != plain.checksum and full.fingerprint_s > 0.0
    assert full.fingerprint == trainer.fingerprint() == fingerprint(trainer.params, trainer.opt_state)


def test_narrow_token_batches_train_exactly_like_int32_ones():
    tokens = _tokens()
    outcomes = {}
    for dtype in (np.int32, np.uint16, np.uint8):
        trainer = _trainer()
        batch = trainer.put_batch(tokens.astype(dtype))
        assert batch.dtype == np.int32
        outcomes[np.dtype(dtype).name] = [trainer.train_step(batch, GLOBAL_TOKENS) for _ in range(2)]
    for name in ("uint16", "uint8"):
        for narrow, wide in zip(outcomes[name], outcomes["int32"]):
            assert (narrow.loss_sum, narrow.checksum) == (wide.loss_sum, wide.checksum)


def test_the_reported_learning_rate_follows_the_optimizers_own_count():
    """The count is kept on the host; a skipped update (non-finite sum) must not advance it."""
    trainer = _trainer()
    batch = trainer.put_batch(_tokens())

    def poisoned(grads, **_):    # an exchange's stand-in (the overlapped step passes order=)
        return [np.full(np.shape(g), np.nan, np.float32) for g in grads], None

    for all_reduce in (None, poisoned, None, None):
        expected = float(trainer.schedule(trainer.opt_count()))
        outcome = trainer.train_step(batch, GLOBAL_TOKENS, all_reduce)
        assert outcome.learning_rate == expected
        assert outcome.skipped == (all_reduce is poisoned)
    assert trainer.opt_count() == 3 and trainer.step == 4
