"""The pure functions a pod compiles: gradient step, update step, evaluation.

They know nothing about meshes; PodTrainer jits them with the pod's shardings under
model.partitioning.activate_rules. Kept apart from the trainer's state handling so that the
within-pod techniques (microbatching, remat, sequence parallelism) change only this file and the
model.

The builders are memoised on their (frozen, hashable) configuration: jax keys its trace and
executable caches on the function object, so a second trainer of the same model in a process (a
DiLoCo replica hosted for a failed pod, a pod reconfigured for the same run, the in-process tests'
pods) takes the first one's traced and compiled programs instead of tracing them again. Each
function is pure in its arguments and sets its own logical-axis rules (rules_for) inside; the mesh
context is part of jax's keys.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from multipod.model import ConfigError, ModelConfig, loss_sums
from multipod.model.loss import prompted_loss_sums
from multipod.model.partitioning import rules_for
from multipod.model.prompt import prompt_embeddings
from multipod.pod_worker.shared_programs import shared


def check_microbatches(rows: int, k: int) -> None:
    """ConfigError unless k microbatches split a pod's batch of `rows` sequences evenly."""
    if rows % k:
        raise ConfigError("model.microbatches", f"{k} does not divide the pod's batch of {rows} sequences")


def split_microbatches(tokens: jax.Array, k: int) -> jax.Array:
    """[b, T+1] -> [k, b/k, T+1]; microbatch i holds rows i, i+k, i+2k, ...

    Strided rather than contiguous so that, with the batch split over the `data` axis in
    contiguous blocks, every device keeps its own rows in every microbatch (no data moves).
    """
    rows = tokens.shape[0]
    check_microbatches(rows, k)
    micro = tokens.reshape(rows // k, k, tokens.shape[1]).swapaxes(0, 1)
    return nn.with_logical_constraint(micro, (None, "batch", "length"))


@functools.lru_cache(maxsize=16)
def make_grad_step(model_cfg: ModelConfig):
    """(params, tokens [b, T+1], normalizer) -> (grads, ce_sum, z_sum).

    The loss is divided by the *global* token count (normalizer), so the pods' gradients sum to
    the gradient of the global-batch mean loss. With model_cfg.microbatches = k > 1 the shard is
    split into k microbatches (split_microbatches) that run one after another inside this one
    program (a scan), accumulating gradients and loss sums in float32: peak activation memory is
    that of b/k sequences. The result equals the unsplit step to float tolerance (only the order
    of the sums differs), and is still one deterministic program, so pods stay bitwise identical.
    The sequence-parallel rules (model_cfg.sequence_parallel) are entered here, at trace time.

    A pod's step runs this program only unsplit (k = 1): with k > 1 it runs
    make_microbatch_grad_step once per microbatch and sums in pod_worker/accumulate.py's fixed
    order, which a gradient assembled on other pods can match bitwise (this scan cannot promise
    that: XLA may fuse its adds into the backward). The scan form stays as the single-program
    reference of within-pod microbatching (tests/unit/pod_worker/test_within_pod.py).
    """
    k = model_cfg.microbatches

    def value_and_grad(params, tokens, normalizer):
        def loss_fn(p):
            ce, z = loss_sums(p, tokens, model_cfg)
            return (ce + z) / normalizer, (ce, z)
        (_, (ce, z)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, ce, z

    def grad_step(params, tokens, normalizer):
        with rules_for(model_cfg):
            if k == 1:
                return value_and_grad(params, tokens, normalizer)
            micro = split_microbatches(tokens, k)

            def accumulate(carry, batch):
                grads, ce, z = value_and_grad(params, batch, normalizer)
                add = lambda a, b: a + b.astype(a.dtype)
                return jax.tree.map(add, carry, (grads, ce, z)), None

            zeros = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                     jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (grads, ce, z), _ = jax.lax.scan(accumulate, zeros, micro)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            return grads, ce, z
    return grad_step


@functools.lru_cache(maxsize=16)
def make_microbatch_grad_step(model_cfg: ModelConfig):
    """(params, tokens [b, T+1], normalizer, m) -> (gradient, ce_sum, z_sum) of microbatch m of
    the shard alone (split_microbatches' rows m, m+k, ...; m an int32 on the devices).

    One program serves every microbatch, so each microbatch's gradient has the same bits whichever
    microbatch, shard or pod it is: the pieces that pod_worker/accumulate.py sums in a fixed order,
    on one pod or (degraded mode) over several. The microbatch is taken inside the program, from
    the shard laid out as the step's input, so a microbatch need not split evenly over the data
    axis (as inside make_grad_step's scan)."""
    k = model_cfg.microbatches
    unsplit = make_grad_step(dataclasses.replace(model_cfg, microbatches=1))

    def grad_step(params, tokens, normalizer, m):
        with rules_for(model_cfg):
            batch = jax.lax.dynamic_index_in_dim(split_microbatches(tokens, k), m, keepdims=False)
            batch = nn.with_logical_constraint(batch, ("batch", "length"))
        return unsplit(params, batch, normalizer)
    return grad_step


@functools.lru_cache(maxsize=16)
def make_apply_update(tx: optax.GradientTransformation):
    """(params, opt_state, summed_grads) -> (params, opt_state, grad_norm, finite).

    Clipping (inside tx) and skip-on-non-finite are decided from the summed gradient, so every
    pod, running this same program on the same bytes, decides the same.
    """
    def apply_update(params, opt_state, grads):
        norm = optax.tree.norm(grads)
        finite = jnp.isfinite(norm)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)
        return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state), norm, finite
    return apply_update


@functools.lru_cache(maxsize=16)
def make_eval_step(model_cfg: ModelConfig):
    """(params, tokens) -> (ce_sum, z_sum)."""
    def eval_step(params, tokens):
        with rules_for(model_cfg):
            return loss_sums(params, tokens, model_cfg)
    return eval_step


def make_prompt_grad_step(model_cfg: ModelConfig, kind: str, hidden: int):
    """Prompt tuning: (prompt_params, base_params, tokens [b, T+1], loss_mask [b, T], normalizer)
    -> (gradient of the prompt parameters alone, ce_sum, z_sum). The base is an input the
    gradient is not taken for: it never changes. The loss counts the masked-in targets, divided
    by their global count (normalizer), so the pods' gradients sum to the global mean's."""
    def grad_step(prompt_params, base, tokens, loss_mask, normalizer):
        with rules_for(model_cfg):
            def loss_fn(p):
                prefix = prompt_embeddings(p, kind, model_cfg.d_model, hidden)
                ce, z = prompted_loss_sums(base, prefix, tokens, loss_mask, model_cfg)
                return (ce + z) / normalizer, (ce, z)
            (_, (ce, z)), grads = jax.value_and_grad(loss_fn, has_aux=True)(prompt_params)
            return grads, ce, z
    return grad_step


def make_prompt_eval_step(model_cfg: ModelConfig, kind: str, hidden: int):
    """(prompt_params, base_params, tokens, loss_mask) -> (ce_sum, z_sum) over the masked-in targets."""
    def eval_step(prompt_params, base, tokens, loss_mask):
        with rules_for(model_cfg):
            prefix = prompt_embeddings(prompt_params, kind, model_cfg.d_model, hidden)
            return prompted_loss_sums(base, prefix, tokens, loss_mask, model_cfg)
    return eval_step


def memory_stats(compiled) -> dict:
    """Per-device bytes of a compiled program, from XLA's memory analysis.

    peak_bytes = arguments + outputs + temporaries - aliased (donated inputs reused as outputs):
    what one device must hold while the program runs. Values are None where the backend gives no
    analysis.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {"argument_bytes": None, "output_bytes": None, "temp_bytes": None, "peak_bytes": None}
    args, outs = int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes)
    temp, alias = int(analysis.temp_size_in_bytes), int(analysis.alias_size_in_bytes)
    return {"argument_bytes": args, "output_bytes": outs, "temp_bytes": temp,
            "peak_bytes": args + outs + temp - alias}


def program_flops(compiled, loop_trips: int = 1) -> float | None:
    """FLOPs one device executes in one run of a compiled program, from XLA's cost analysis.

    This is hardware FLOPs: whatever the program really computes, recomputation included.
    XLA's cost analysis counts a while loop's body once, so for the microbatch scan (the only
    loop in the step programs, around nearly all of the work) the caller passes its trip count.
    None if the backend gives no analysis.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax returned one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"]) * loop_trips


# -- the on-device state checksum ------------------------------------------------------------------
# Per leaf, one 32-bit wrapping sum over its elements of xorshift(bits) * weight(position), with an
# odd weight: the xorshift is a bijection of uint32 and multiplying by an odd number is one too, so
# a changed element always changes its term, and so the sum, whatever bits changed. The position
# (the element's row-major index) weight makes swapped or shifted values change the sum. Integer
# addition is exact and associative, so the sum of a sharded leaf does not depend on how XLA splits
# it: equal bytes give an equal checksum on any mesh, on every pod. The leaves' sums are chained in
# order into two 32-bit accumulators, each mixed with the leaf's index, shape and dtype.
#
# Where the leaves live (SPMD): each leaf keeps its shape, and the position comes from one iota per
# axis, so every device sums its own shard and only a scalar per leaf is all-reduced. Flattening a
# leaf split over the model axis instead made XLA all-gather it first: every step, on every device,
# a copy of every tensor-parallel leaf of the parameters and optimizer state.
# Speed (XLA CPU): an integer reduce is not vectorised; so a big leaf is first folded 8:1 by
# elementwise adds of 8 contiguous slices along an axis that is not split over devices (slicing a
# split axis moves data between them), and only 1/8 of it is reduced.
# Speed (tracing, paid at every worker start): written in lax primitives, with the chain over the
# leaves as one scan. jnp's operators and a Python chain over every leaf of the state took about
# 0.15 s of trace and 0.05 s of lowering for the tiny model's 56 leaves; now about 0.03 s each,
# with the same values (integer operations; test_checksum.py holds them to a NumPy restatement).
_FOLD = 8
_POS_MUL, _POS_ADD = 0x9E3779B1, 0x7F4A7C15


def _u32(value: int) -> np.uint32:
    return np.uint32(value & 0xFFFFFFFF)


def _xorshift(h: jax.Array, shift: int) -> jax.Array:
    return jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, _u32(shift)))


def _mix32(h: jax.Array, mul1: int = 0x85EBCA6B, mul2: int = 0xC2B2AE35) -> jax.Array:
    h = jax.lax.mul(_xorshift(h, 16), _u32(mul1))
    h = jax.lax.mul(_xorshift(h, 13), _u32(mul2))
    return _xorshift(h, 16)


def _leaf_bits(leaf: jax.Array) -> jax.Array:
    """A leaf's bits as uint32, one word per element, in the leaf's shape (narrower types widened;
    64-bit ones split in two along a new last axis; a scalar as one element)."""
    dtype = jnp.dtype(leaf.dtype)
    if dtype == jnp.bool_:
        bits = leaf.astype(jnp.uint32)
    elif dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(leaf, jnp.uint32)       # [..., 2]
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize]
        bits = leaf if dtype == unsigned else jax.lax.bitcast_convert_type(leaf, unsigned)
        bits = bits.astype(jnp.uint32)
    return bits.reshape(1) if bits.ndim == 0 else bits


def _leaf_salt(index: int, leaf) -> int:
    """A 32-bit constant from the leaf's place in the state, shape and dtype (fixed at trace time)."""
    text = f"{index}|{tuple(leaf.shape)}|{jnp.dtype(leaf.dtype).name}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


def _split_axes(leaf, sharding) -> frozenset[int]:
    """The axes of `leaf` that `sharding` splits over devices (none without a sharding)."""
    if sharding is None or leaf.ndim == 0:
        return frozenset()
    return frozenset(a for a, (whole, part) in enumerate(zip(leaf.shape, sharding.shard_shape(leaf.shape)))
                     if part != whole)


def _leaf_sum(bits: jax.Array, salt: int, split: frozenset[int] = frozenset()) -> jax.Array:
    """sum_i xorshift(bits_i) * weight(i) mod 2^32 over the row-major index i, weight(i) odd and
    salted; `split`: the axes split over devices, never sliced."""
    lax = jax.lax
    shape = bits.shape
    pos, stride = None, 1
    for axis in reversed(range(len(shape))):    # the row-major index, wrapping as uint32 does
        index = lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index if stride == 1 else lax.mul(index, _u32(stride))
        pos = index if pos is None else lax.add(pos, index)
        stride *= shape[axis]
    weight = lax.bitwise_or(lax.add(lax.mul(pos, _u32(_POS_MUL)), _u32(_POS_ADD ^ salt)), _u32(1))
    terms = lax.mul(_xorshift(bits, 15), weight)
    fold = next((a for a in range(len(shape)) if a not in split and shape[a] % _FOLD == 0), None)
    if bits.size >= _FOLD * 1024 and fold is not None:
        m = shape[fold] // _FOLD
        folded = lax.slice_in_dim(terms, 0, m, axis=fold)
        for j in range(1, _FOLD):
            folded = lax.add(folded, lax.slice_in_dim(terms, j * m, (j + 1) * m, axis=fold))
        terms = folded
    return lax.reduce_sum(terms, tuple(range(len(shape))))


def _chain(acc: tuple[jax.Array, jax.Array], total: jax.Array):
    """One leaf's sum chained into the two accumulators (a multiply-add, then a bijective mix), so
    each leaf counts at its place."""
    lax = jax.lax
    first = _mix32(lax.add(lax.mul(acc[0], _u32(0x01000193)), total))
    second = _mix32(lax.add(lax.mul(acc[1], _u32(0x2545F491)), lax.bitwise_xor(total, _u32(0x5BD1E995))),
                    0x7FEB352D, 0x846CA68B)
    return (first, second), None


def state_checksum(*trees, shardings: tuple | None = None) -> jax.Array:
    """uint32[2]: a checksum of every leaf of `trees` (bits, position, leaf index, shape, dtype),
    computed where the leaves live. Any single changed bit of any leaf changes it; equal leaves
    give an equal checksum whatever their sharding. `shardings`: where each leaf lives, in tree
    order (checksum_program), so that the sum never slices an axis split over devices; it does not
    change the value. Not cryptographic: the fingerprint (BLAKE2b of a host copy,
    trainer.fingerprint) is still taken at checkpoints and every run.fingerprint_every steps."""
    leaves = jax.tree.leaves(trees)
    if shardings is not None and len(shardings) != len(leaves):
        raise ValueError(f"{len(shardings)} shardings for a state of {len(leaves)} leaves")
    acc = (jnp.uint32(0x6A09E667), jnp.uint32(0xBB67AE85))
    totals = []
    for index, leaf in enumerate(leaves):
        salt = _leaf_salt(index, leaf)
        split = _split_axes(leaf, None if shardings is None else shardings[index])
        totals.append(jax.lax.bitwise_xor(_leaf_sum(_leaf_bits(leaf), salt, split), _u32(salt)))
    if totals:
        acc, _ = jax.lax.scan(_chain, acc, jnp.stack(totals))
    return jnp.stack(acc)


def checksum_program(*sharding_trees, out_sharding=None):
    """state_checksum jitted for states laid out as `sharding_trees` (one tree of shardings per
    argument, e.g. the parameters' and the optimizer state's); returns uint32[2] on out_sharding.
    The same program object for the same layout (shared_programs: jax's caches then hit)."""
    return _checksum_program(sharding_trees, out_sharding)


@shared
def _checksum_program(sharding_trees: tuple, out_sharding):
    shardings = tuple(jax.tree.leaves(sharding_trees))
    return jax.jit(functools.partial(state_checksum, shardings=shardings), in_shardings=sharding_trees,
                   out_shardings=out_sharding)


def checksum_hex(words) -> str:
    """state_checksum's words as a hex string."""
    return "".join(f"{int(w):08x}" for w in words)
