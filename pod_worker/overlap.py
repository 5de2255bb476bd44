"""The gradient step as per-layer programs, so the DCN exchange overlaps the backward pass.

The fused step (programs.make_grad_step) is one compiled program: its gradient exists only when
the whole backward pass is done. Here the same maths runs as a chain of small programs, all
dispatched at once (JAX dispatch is asynchronous), and each block's gradient can leave the pod
as soon as its backward program has run, while the earlier blocks' backward programs still run:

  forward   embed(embedding, inputs) -> x0
            block(params_i, x_i) -> x_{i+1}, vjp_i        for i = 0 .. L-1 (vjp_i: the residuals)
  head      loss(embedding, final_norm, x_L) -> d embedding (output part), d final_norm, d x_L,
            and the loss sums
  backward  vjp_i(d x_{i+1}) -> d params_i, d x_i         for i = L-1 .. 1
            block 0 in two programs from the same residuals: first only the gradient of its
            largest sub-module (the MLP), then the rest and d x0
            embedding gradient = output part + input part (scatter of d x0), complete last

Readiness order of the gradient leaves: final_norm, block_{L-1}, ..., block_1, block_0's largest
sub-module, the rest of block_0, embedding. What the step waits for after its backward pass is
the sending of what became ready last; splitting block 0 makes that the small rest of it and the
embedding instead of a whole block. The price: the two block-0 programs each compute what both
need (XLA drops the rest of each), about one matmul of the MLP's backward twice.
`Launched.order` lists the leaf indices (in the parameters' tree order) in that order; the
exchange takes them in it. Each block's vjp keeps exactly the residuals the fused step keeps (with
model.remat, the block is a remat region here as there, so only what the policy saves is kept).

Microbatches (model.microbatches = M > 1): the shard is split as the fused step splits it
(programs.split_microbatches: microbatch m holds rows m, m+M, ...), and every microbatch runs the
same chain of programs. The gradient is accumulated part by part in the fixed order of
pod_worker/accumulate.py (float32 from g_0, by add programs of their own; the fused step uses
the same programs), so a microbatch's gradient can be computed on another pod and summed in this
order to the same bits (`gradient` computes one batch's without summing). Only the last
microbatch's parts are sent: each is its sum, ready as soon as that microbatch's backward program
for it has run, so the exchange still overlaps the last backward pass. The loss sums add up in
the same order.

The result equals the fused step's to float tolerance, not bitwise (XLA fuses differently across
program boundaries); every pod runs the same programs on the same mesh shape, so the pods'
gradients are still computed identically and their pod-order sum is bitwise equal everywhere.
On a pod of several hosts every host dispatches the same programs in the same order (each is one
SPMD program over the pod's devices), and the caller sends this host's block of each leaf.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from multipod.model import ModelConfig, abstract_params, token_losses
from multipod.model.layers import RESIDUAL, RMSNorm, constrain
from multipod.model.partitioning import activate_rules, rules_for
from multipod.model.transformer import block_class, embed_tokens, unembed
from multipod.pod_worker.accumulate import MicrobatchSum
from multipod.pod_worker.hosts import start_host_copy
from multipod.pod_worker.shared_programs import shared


def block_names(model_cfg: ModelConfig) -> list[str]:
    return [f"block_{i}" for i in range(model_cfg.n_layers)]


def early_part(block_params) -> str:
    """The name of a block's largest sub-module (by parameter count; leaves: arrays or shapes):
    block 0 sends it first."""
    sizes = {name: sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(sub))
             for name, sub in block_params.items()}
    return max(sorted(sizes), key=lambda name: sizes[name])


def readiness_order(params_tree, model_cfg: ModelConfig) -> list[int]:
    """Indices of the flattened parameter leaves (jax.tree.leaves order) in the order the
    overlapped backward pass completes them: final_norm, the blocks from last to first (block 0's
    largest sub-module before the rest of it), then the embedding."""
    first = block_names(model_cfg)[0]
    early = early_part(params_tree[first])
    by_part: dict[str | tuple[str, bool], list[int]] = {}
    for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params_tree)[0]):
        part: str | tuple[str, bool] = path[0].key
        if part == first:
            part = (first, path[1].key == early)
        by_part.setdefault(part, []).append(index)
    parts: list[str | tuple[str, bool]] = ["final_norm", *reversed(block_names(model_cfg)[1:]), (first, True),
                                           (first, False), "embedding"]
    if sorted(map(str, parts)) != sorted(map(str, by_part)):
        raise ValueError(f"parameter tree has parts {sorted(map(str, by_part))}, expected {sorted(map(str, parts))}")
    return [index for part in parts for index in by_part[part]]


def make_stage_functions(model_cfg: ModelConfig):
    """The pure functions of the split step (meshes are the caller's business, as in programs.py):
    embed, block_forward, head, block_backward, embed_backward."""
    c = model_cfg
    block = block_class(c)(c)

    def embed(embedding, tokens):
        with rules_for(c):
            return embed_tokens(embedding.astype(c.compute_dtype), tokens[:, :-1])

    def block_forward(params, x):
        with rules_for(c):
            return jax.vjp(lambda p, h: block.apply({"params": p}, h), params, x)

    def head(embedding, final_norm, x, tokens, normalizer):
        def loss(e, n, h):
            h = constrain(RMSNorm(c).apply({"params": n}, h), RESIDUAL)
            ce, z = token_losses(unembed(h, e.astype(c.compute_dtype), c), tokens[:, 1:], c.z_loss_weight)
            ce, z = jnp.sum(ce), jnp.sum(z)
            return (ce + z) / normalizer, (ce, z)
        with rules_for(c):
            (_, (ce, z)), (g_emb, g_norm, g_x) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
                embedding, final_norm, x)
            return g_emb, g_norm, g_x, ce, z

    def block_backward(vjp, g_y):
        with rules_for(c):
            return vjp(g_y)

    def embed_backward(embedding, tokens, g_x0, g_emb_head):
        with rules_for(c):
            _, vjp = jax.vjp(lambda e: embed_tokens(e.astype(c.compute_dtype), tokens[:, :-1]), embedding)
            (g_emb_input,) = vjp(g_x0)
            return g_emb_head + g_emb_input

    return embed, block_forward, head, block_backward, embed_backward


@dataclass
class Launched:
    """One overlapped gradient step in flight: every program is dispatched, nothing waited for."""
    leaves: list[jax.Array]   # gradient leaves in the parameters' tree order (being computed)
    order: list[int]          # leaf indices in readiness order
    ce: jax.Array
    z: jax.Array
    _done: threading.Event
    _done_at: list[float]

    def backward_end(self, timeout: float | None = None) -> float:
        """time.perf_counter() at which the last gradient leaf (the embedding's) was ready."""
        if not self._done.wait(timeout):
            raise TimeoutError("the overlapped backward pass did not finish")
        return self._done_at[0]


class OverlappedGradStep:
    """The split gradient step of one pod, compiled over its mesh with the fused step's shardings
    and logical rules. `launch` dispatches it; the caller reads the leaves in `order`."""

    def __init__(self, model_cfg: ModelConfig, mesh, param_sharding, summer: MicrobatchSum | None = None):
        self.config = model_cfg
        self.summer = summer or MicrobatchSum(model_cfg, mesh)
        self.mesh = mesh
        self.param_sharding = param_sharding
        shapes = abstract_params(model_cfg)
        self.order = readiness_order(shapes, model_cfg)
        self._treedef = jax.tree.structure(param_sharding)
        programs = _stage_programs(model_cfg, mesh, param_sharding)
        self.early = programs["early"]
        self._embed, self._block_forward, self._head = programs["embed"], programs["block_forward"], programs["head"]
        self._block_backward, self._embed_backward = programs["block_backward"], programs["embed_backward"]
        self._first_block_early, self._first_block_rest = programs["first_block_early"], programs["first_block_rest"]

    def launch(self, params, tokens: jax.Array, normalizer: jax.Array, to_host: bool = True) -> Launched:
        """Dispatch the whole step (forward, head, backward block by block, for each microbatch)
        and, with to_host, start each gradient's device->host copy as soon as its program is
        queued. Returns at once."""
        start_copies = _start_copies if to_host else (lambda tree: None)
        m_count = self.config.microbatches
        with activate_rules(self.mesh):
            if m_count == 1:
                def ready(index, g):
                    start_copies(g)
                    return g
                grads, ce, z = self._chain(params, tokens, normalizer, ready)
            else:
                grads, ce, z = self._accumulate(params, tokens, normalizer, m_count, start_copies)
        leaves, treedef = jax.tree.flatten(grads)
        if treedef != self._treedef:  # type: ignore[operator]   # jax's PyTreeDef stub lacks __ne__
            raise AssertionError(f"gradient tree {treedef} != parameter tree {self._treedef}")
        done, done_at = threading.Event(), [0.0]
        last = grads["embedding"]

        def watch():
            try:
                last.block_until_ready()
            finally:
                done_at[0] = time.perf_counter()
                done.set()
        threading.Thread(target=watch, name="overlap-backward-end", daemon=True).start()
        return Launched(leaves, list(self.order), ce, z, done, done_at)

    def gradient(self, params, tokens, normalizer):
        """(gradient tree, ce, z) of one batch (e.g. one microbatch) through the chain of
        programs, dispatched and not waited for; nothing summed, nothing copied."""
        with activate_rules(self.mesh):
            return self._chain(params, tokens, normalizer, lambda index, g: g)

    def _accumulate(self, params, tokens, normalizer, m_count: int, start_copies):
        """Every microbatch through the chain; each part's gradient summed in microbatch order
        (0, 1, ..., M-1) by the summer's programs, the last microbatch's sums handed out (and
        copied) as they are dispatched. Returns (gradient tree, ce, z)."""
        acc: list = []      # by part, in the order _chain yields them
        losses = None
        for m in range(m_count):
            micro = self.summer.microbatch(tokens, m)

            def part(index, g, m=m):
                total = self.summer.fold(acc[index] if m else None, g, m)
                if m == 0:
                    acc.append(total)
                    return g
                acc[index] = total
                if m < m_count - 1:
                    return g
                start_copies(total)
                return total
            grads, ce_m, z_m = self._chain(params, micro, normalizer, part)
            losses = self.summer.add_losses(losses, ce_m, z_m)
        assert losses is not None
        return grads, *losses

    def _chain(self, params, tokens, normalizer, part):
        """Dispatch one batch's forward and backward programs; `part(index, gradient)` is called
        on each part's gradient (index counting the parts in readiness order) as soon as its
        program is queued, and its result kept. Returns (gradient tree, ce, z)."""
        names = block_names(self.config)
        index = iter(range(len(names) + 3))
        x = self._embed(params["embedding"], tokens)
        vjps = []
        for name in names:
            x, vjp = self._block_forward(params[name], x)
            vjps.append(vjp)
        g_emb_head, g_norm, g_x, ce, z = self._head(params["embedding"], params["final_norm"], x,
                                                    tokens, normalizer)
        grads = {"final_norm": part(next(index), g_norm)}
        for name, vjp in zip(reversed(names[1:]), reversed(vjps[1:])):
            g_p, g_x = self._block_backward(vjp, g_x)
            grads[name] = part(next(index), g_p)
        early = part(next(index), self._first_block_early(vjps[0], g_x))
        rest, g_x = self._first_block_rest(vjps[0], g_x)
        grads[names[0]] = {**part(next(index), rest), self.early: early}
        del vjps
        grads["embedding"] = part(next(index), self._embed_backward(params["embedding"], tokens, g_x, g_emb_head))
        return grads, ce, z


@shared
def _stage_programs(model_cfg: ModelConfig, mesh, param_sharding) -> dict:
    """The per-layer programs of OverlappedGradStep for a config and a layout, and the name of the
    first block's sub-module whose gradient goes first ("early"): one set per process for equal
    arguments (shared_programs)."""
    shapes = abstract_params(model_cfg)
    embed, block_forward, head, block_backward, embed_backward = make_stage_functions(model_cfg)
    # Every block has the same shapes and shardings, so one compiled program serves them all.
    block_sharding = param_sharding[block_names(model_cfg)[0]]
    emb_sharding, norm_sharding = param_sharding["embedding"], param_sharding["final_norm"]
    pin = jax.lax.with_sharding_constraint

    def head_pinned(*args):
        g_emb, g_norm, g_x, ce, z = head(*args)
        return pin(g_emb, emb_sharding), pin(g_norm, norm_sharding), g_x, ce, z

    def block_backward_pinned(vjp, g_y):
        g_p, g_x = block_backward(vjp, g_y)
        return pin(g_p, block_sharding), g_x

    early = early_part(shapes[block_names(model_cfg)[0]])

    def first_block_early(vjp, g_y):    # only the largest sub-module's gradient
        g_p, _ = block_backward(vjp, g_y)
        return pin(g_p[early], block_sharding[early])

    def first_block_rest(vjp, g_y):     # the other sub-modules' gradients and d x0
        g_p, g_x = block_backward(vjp, g_y)
        rest = {name: g for name, g in g_p.items() if name != early}
        return pin(rest, {name: block_sharding[name] for name in rest}), g_x

    def embed_backward_pinned(*args):
        return pin(embed_backward(*args), emb_sharding)

    return {"early": early, "embed": jax.jit(embed), "block_forward": jax.jit(block_forward),
            "head": jax.jit(head_pinned),
            # The residuals are not donated: the block's parameters are among them.
            "block_backward": jax.jit(block_backward_pinned),
            "first_block_early": jax.jit(first_block_early), "first_block_rest": jax.jit(first_block_rest),
            "embed_backward": jax.jit(embed_backward_pinned, donate_argnums=(3,))}


def _start_copies(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        start_host_copy(leaf)
