"""Generation on one pod's mesh: model/decode.py's prefill and decode programs, compiled with the
shardings of the rules table (partitioning.py), so the parameters are laid out as in training
(heads, MLP units and the vocabulary split over `model`) and the KV cache as the K/V activations
(batch over `data`, K/V heads replicated). The host loop and the sampler are the model's.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding

from multipod.model import Chunk, Decoder, ModelConfig, Sampling
from multipod.model.decode import cache_axes
from multipod.model.partitioning import activate_rules, logical_rules, replicated

# What a Generate request may ask for at once (prompts per request, tokens per prompt).
MAX_PROMPTS = 256
MAX_NEW_TOKENS = 4096

__all__ = ["MAX_NEW_TOKENS", "MAX_PROMPTS", "Chunk", "Generator", "Sampling", "collect"]


def collect(chunks: Iterable[Chunk], count: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A stream's completions as int32 [count, num_tokens], each row padded with -1 after its end,
    and the number of tokens of each."""
    out = np.full((count, num_tokens), -1, np.int32)
    lengths = np.zeros(count, np.int64)
    for chunk in chunks:
        out[chunk.rows, chunk.index] = chunk.tokens
        lengths[chunk.rows] = chunk.index + 1
    return out, lengths


class Generator(Decoder):
    """Prefill and decode compiled for `mesh`; params must be laid out by `param_sharding`
    (partitioning.param_shardings: what the pod's trainer uses). Batches are padded to a multiple
    of the mesh's data axis. stream() yields each new token row as soon as it is known. With
    prefix_len (a prompt-tuned pod), params is (model parameters, virtual-token embeddings), the
    embeddings replicated."""

    def __init__(self, config: ModelConfig, mesh, param_sharding, max_len: int | None = None, prefix_len: int = 0):
        self.mesh = mesh
        self.param_sharding = (param_sharding, replicated(mesh)) if prefix_len else param_sharding
        super().__init__(config, max_len, batch_multiple=mesh.shape["data"], prefix_len=prefix_len)

    def _sharding(self, *names: str) -> NamedSharding:
        return NamedSharding(self.mesh, nn.logical_to_mesh_axes(names, logical_rules()))

    def compile(self, name: str, fn: Callable) -> Callable:
        # What the host loop makes (prompt tokens, lengths, positions, row ids, sampling values)
        # and reads back (the next tokens) is replicated: a few bytes per row on every device. So
        # host arrays go in as they are and the next tokens come out whole on every host, also on
        # a pod of several hosts, where jax refuses a host array split over several processes'
        # devices and no host can read a row held by another. Inside, the rules table splits the
        # activations and the cache over `data` as in training.
        host = replicated(self.mesh)
        cache = [{k: self._sharding(*axes) for k, axes in layer.items()} for layer in cache_axes(self.config)]
        if name == "init_cache":
            return jax.jit(fn, in_shardings=(host,), out_shardings=cache)
        logits = self._sharding("batch", "vocab")
        return jax.jit(fn, in_shardings=(self.param_sharding, cache, *[host] * 8),
                       out_shardings=(host, cache, logits), donate_argnums=(1,))

    def run(self, name: str, *args):
        # The model's activation constraints resolve against the mesh when a program is traced.
        with activate_rules(self.mesh):
            return super().run(name, *args)

    def put_params(self, params) -> dict:
        """Host (or differently laid out) parameters onto this mesh, laid out as in training."""
        return jax.device_put(params, self.param_sharding)
