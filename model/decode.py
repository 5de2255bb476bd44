"""Autoregressive decoding with a KV cache, on the training model's parameters and code.

The Transformer (transformer.py, layers.py) takes an optional cache: one {"key", "value"} pair
per block, each [batch, max_len, kv_heads, head_dim] with the logical axes
("batch", "length", "kv_heads", "kv"), so the rules table shards it like the K/V activations of
training (batch over `data`, K/V heads replicated). Decoding is two programs:
- prefill: every prompt of the batch in one call, right-padded to a common length. Row b's
  prompt has lengths[b] tokens at positions 0..lengths[b]-1; its next token comes from the logits
  at lengths[b]-1. Its padding is written into the cache too, but only at positions the row's
  generated tokens overwrite before any query can see them, so each row computes exactly what it
  would alone (prompts of different lengths need no left padding and no attention mask of their
  own).
- decode: one new token per row, at that row's own position.
Both end with the sampler, so only token ids leave the devices.

Sampling: greedy (temperature 0), or softmax(logits / temperature) restricted to the top_k most
likely tokens and then to the nucleus of probability top_p (ties at a cut-off are kept). The key
of generated token i of row r is fold_in(fold_in(PRNGKey(seed), r), i): a sample depends on the
seed, the row's index in the batch and the position, never on the batch size or the padding. The
draw is one uniform number per row looked up in the cumulative distribution, so sampling costs
about what greedy does (a Gumbel draw per vocabulary entry took 3x the decode step at batch 32).

Contexts longer than max_len: refused, unless shift_context; then, when a row's next token would
not fit, every row continues from its last max_len // 2 tokens (prefilled again).

`Decoder` is the host loop over those programs (a Python generator yielding each new token row);
pod_worker/generation.py compiles the same programs with a mesh's shardings.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from multipod.model.config import ModelConfig, RematPolicy
from multipod.model.layers import CACHE
from multipod.model.transformer import Transformer

# Prompts are padded up to a power of two (at least this, at most max_len): one prefill program
# serves many prompt lengths.
MIN_PREFILL_LEN = 8


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 is greedy (top_k, top_p and seed unused)."""
    temperature: float = 0.0
    top_k: int = 0          # 0: no limit
    top_p: float = 1.0      # 1: no nucleus cut
    seed: int = 0

    def validate(self) -> Sampling:
        """ValueError naming the first bad value."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        return self


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Generated token `index` (0: the first after the prompt) of the rows still generating:
    tokens[j] belongs to prompt rows[j]. A row that has emitted the end token leaves later chunks."""
    index: int
    rows: np.ndarray        # int64 [n]
    tokens: np.ndarray      # int32 [n]


def decoding_config(config: ModelConfig) -> ModelConfig:
    """The config decoding runs the model with: the same parameters and math, without the
    training-only layout choices (remat, sequence parallelism, microbatches)."""
    return dataclasses.replace(config, remat=RematPolicy.NONE, sequence_parallel=False, microbatches=1)


def cache_axes(config: ModelConfig) -> list[dict]:
    """The cache's logical axis names, as a tree like the cache (for partitioning)."""
    return [{"key": CACHE, "value": CACHE} for _ in range(config.n_layers)]


def init_cache(config: ModelConfig, batch: int, max_len: int) -> list[dict]:
    """An empty cache: per block, K and V zeros [batch, max_len, kv_heads, head_dim]."""
    shape = (batch, max_len, config.n_kv_heads, config.head_dim)
    return [{"key": jnp.zeros(shape, config.compute_dtype), "value": jnp.zeros(shape, config.compute_dtype)}
            for _ in range(config.n_layers)]


def _run(model: Transformer, params, tokens: jax.Array, cache: list, start: jax.Array,
         prefix: jax.Array | None = None) -> tuple[jax.Array, list]:
    """The model with a cache: (logits, the updated cache)."""
    # cast: flax types apply() as the output or an (output, variables) pair; without `mutable`
    # it is the output alone, here the model's (logits, cache).
    return cast(tuple[jax.Array, list], model.apply({"params": params}, tokens, cache, start, prefix=prefix))


def prefill(params, config: ModelConfig, cache: list, tokens: jax.Array, lengths: jax.Array,
            prefix: jax.Array | None = None):
    """Run the prompts tokens [B, P] (row b's real tokens: the first lengths[b]) into `cache` from
    position 0; returns (float32 logits [B, vocab] at each row's last prompt token, cache). With
    `prefix` (virtual-token embeddings [N, d], model/prompt.py) the prompts sit after it, at
    positions N ..."""
    model = Transformer(decoding_config(config))
    start = jnp.zeros(tokens.shape[:1], jnp.int32)
    logits, cache = _run(model, params, tokens, cache, start, prefix=prefix)
    before = 0 if prefix is None else prefix.shape[0]
    last = jnp.take_along_axis(logits, (lengths + before - 1)[:, None, None], axis=1)[:, 0]
    return last, cache


def decode_step(params, config: ModelConfig, cache: list, tokens: jax.Array, positions: jax.Array):
    """One token per row (tokens int32 [B]) at row b's position positions[b]; returns (float32
    logits [B, vocab] for the token after it, cache)."""
    model = Transformer(decoding_config(config))
    logits, cache = _run(model, params, tokens[:, None], cache, positions)
    return logits[:, 0], cache


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [B, V] with every token outside the top_k (0: all) and then outside the nucleus of
    probability top_p set to -inf. A token tied with the last one kept is kept too."""
    vocab = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_top_k = jnp.arange(vocab)[None, :] < k
    probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs       # probability of the tokens ranked above
    keep = in_top_k & ((before < top_p) | (top_p >= 1.0))
    count = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    cutoff = jnp.take_along_axis(desc, count - 1, axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample_next(logits: jax.Array, key: jax.Array, index: jax.Array, rows: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The next token of every row (int32 [B]): argmax with temperature 0, else a draw from the
    filtered softmax(logits / temperature) with the key of (row, index): one uniform number per
    row, looked up in the cumulative distribution (no random bits per vocabulary entry). Only the
    branch the request needs runs (the sort of top-k/top-p only when one is set)."""
    def greedy(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        scaled = logits / temperature
        scaled = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda x: filter_logits(x, top_k, top_p), lambda x: x,
                              scaled)
        cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), index))(rows)
        u = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]
        above = cdf > u[:, None]
        # The first token whose cumulative probability passes u (its own probability is > 0).
        return jnp.where(above.any(axis=-1), jnp.argmax(above, axis=-1), greedy(logits)).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, greedy, logits)


def programs(config: ModelConfig, max_len: int, prefix_len: int = 0) -> dict[str, Callable]:
    """The pure functions a Decoder compiles (with prefix_len > 0, `params` is the pair
    (model parameters, virtual-token embeddings [prefix_len, d]) and the prompts follow them):
    init_cache(batch_template int32 [B]) -> cache;
    prefill(params, cache, tokens [B, P], lengths [B], rows [B], key, index, temperature, top_k, top_p)
        -> (next tokens [B], cache, logits [B, V]);
    decode(params, cache, tokens [B], positions [B], rows [B], key, index, temperature, top_k, top_p)
        -> (next tokens [B], cache, logits [B, V])."""
    config = decoding_config(config)

    def init(template):
        return init_cache(config, template.shape[0], max_len)

    def run_prefill(params, cache, tokens, lengths, rows, key, index, temperature, top_k, top_p):
        params, prefix = params if prefix_len else (params, None)
        logits, cache = prefill(params, config, cache, tokens, lengths, prefix)
        return sample_next(logits, key, index, rows, temperature, top_k, top_p), cache, logits

    def run_decode(params, cache, tokens, positions, rows, key, index, temperature, top_k, top_p):
        params = params[0] if prefix_len else params
        logits, cache = decode_step(params, config, cache, tokens, positions)
        return sample_next(logits, key, index, rows, temperature, top_k, top_p), cache, logits

    return {"init_cache": init, "prefill": run_prefill, "decode": run_decode}


def check_request(config: ModelConfig, prompts: list[np.ndarray], num_tokens: int, sampling: Sampling,
                  eos_id: int | None = None, shift_context: bool = False, max_len: int | None = None) -> None:
    """ValueError saying what is wrong with a generation request, and the limit it breaks."""
    max_len = max_len or config.max_seq_len
    if not prompts:
        raise ValueError("no prompt given")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    sampling.validate()
    if eos_id is not None and not 0 <= eos_id < config.vocab_size:
        raise ValueError(f"eos_id {eos_id} is not a token id of the model: ids are in [0, {config.vocab_size})")
    for i, prompt in enumerate(prompts):
        name = "the prompt" if len(prompts) == 1 else f"prompt {i}"
        n = len(prompt)
        if n == 0:
            raise ValueError(f"{name} is empty: give at least one token")
        if prompt.min() < 0 or prompt.max() >= config.vocab_size:
            raise ValueError(f"{name}: token ids must be in [0, {config.vocab_size})")
        if n > max_len:
            raise ValueError(f"{name} has {n} tokens, more than the model's context of {max_len} tokens "
                             f"(model.max_seq_len)")
        if not shift_context and n + num_tokens > max_len:
            raise ValueError(f"{name} ({n} tokens) + {num_tokens} new tokens = {n + num_tokens} exceed the model's "
                             f"context of {max_len} tokens (model.max_seq_len): at most {max_len - n} new tokens "
                             f"fit after it (or shift the context)")


def prng_key(seed: int) -> np.ndarray:
    """The raw uint32[2] key of a 64-bit seed."""
    key = jax.random.PRNGKey(seed & 0xFFFFFFFF)
    if seed >> 32:
        key = jax.random.fold_in(key, seed >> 32)
    return np.asarray(key)


def bucket(length: int, max_len: int) -> int:
    """The padded prompt length of a prefill: a power of two >= length, within [MIN_PREFILL_LEN, max_len]."""
    return min(max_len, max(MIN_PREFILL_LEN, 1 << max(0, length - 1).bit_length()))


class Decoder:
    """Generation with a KV cache: the host loop over the compiled prefill and decode programs.

    This class compiles them with plain jax.jit (one device); pod_worker/generation.py's
    Generator compiles them for a mesh. Batches are padded to a multiple of `batch_multiple`
    rows (the mesh's data axis) and prompts to a power of two, so a few programs serve every
    request. Thread-safe: a call keeps its state in its own generator.

    prefix_len > 0 (a prompt-tuned model): `params` is (model parameters, virtual-token
    embeddings [prefix_len, d]); they take the first prefix_len positions of the context, so a
    prompt and its completion have max_len - prefix_len.
    """

    def __init__(self, config: ModelConfig, max_len: int | None = None, batch_multiple: int = 1,
                 prefix_len: int = 0):
        config.validate()
        self.config = config
        self.max_len = max_len or config.max_seq_len
        if not 0 <= prefix_len < self.max_len:
            raise ValueError(f"{prefix_len} virtual tokens leave no room in a context of {self.max_len}")
        self.prefix_len = prefix_len
        self.context = self.max_len - prefix_len    # positions left for a prompt and its completion
        self.batch_multiple = batch_multiple
        self._programs = {name: self.compile(name, fn)
                          for name, fn in programs(config, self.max_len, prefix_len).items()}

    def compile(self, name: str, fn: Callable) -> Callable:
        """The compiled program `name` (see programs()); the cache argument of prefill and decode
        is donated (updated in place)."""
        return jax.jit(fn, donate_argnums=(1,) if name != "init_cache" else ())

    def run(self, name: str, *args):
        """Call compiled program `name` (a subclass may set the scene, e.g. the mesh's rules)."""
        return self._programs[name](*args)

    def check(self, prompts, num_tokens: int, sampling: Sampling, eos_id: int | None = None,
              shift_context: bool = False) -> list[np.ndarray]:
        """The prompts as int32 arrays; ValueError if the request cannot run (check_request)."""
        prompts = [np.asarray(p).astype(np.int32).reshape(-1) for p in prompts]
        check_request(self.config, prompts, num_tokens, sampling, eos_id, shift_context, self.context)
        return prompts

    def _prefill(self, params, contexts: list[list[int]], rows, key, index: int, scalars):
        """Prefill `contexts` (one per padded row) into a fresh cache; (next tokens, cache, positions)."""
        lengths = np.array([len(c) for c in contexts], np.int32)
        tokens = np.zeros((len(contexts), bucket(int(lengths.max()), self.context)), np.int32)
        for r, context in enumerate(contexts):
            tokens[r, :len(context)] = context
        cache = self.run("init_cache", lengths)
        next_tokens, cache, _ = self.run("prefill", params, cache, tokens, lengths, rows, key, np.int32(index),
                                         *scalars)
        return next_tokens, cache, lengths + self.prefix_len

    def stream(self, params, prompts, num_tokens: int, sampling: Sampling = Sampling(), eos_id: int | None = None,
               shift_context: bool = False) -> Iterator[Chunk]:
        """Generate up to num_tokens tokens after each prompt (1-d int arrays), yielding one Chunk
        per position as soon as it is known. With eos_id, a row stops after emitting it (and the
        stream ends when every row has). ValueError at once (before the first next()) if the
        request cannot run."""
        prompts = self.check(prompts, num_tokens, sampling, eos_id, shift_context)
        return self._stream(params, prompts, num_tokens, sampling, eos_id, shift_context)

    def _stream(self, params, prompts, num_tokens, sampling, eos_id, shift_context) -> Iterator[Chunk]:
        if num_tokens == 0:
            return
        count = len(prompts)
        padded = -(-count // self.batch_multiple) * self.batch_multiple
        contexts = [p.tolist() for p in prompts] + [[0]] * (padded - count)   # pad rows: one token
        rows = np.arange(padded, dtype=np.int32)
        key = prng_key(sampling.seed)
        scalars = (np.float32(sampling.temperature), np.int32(sampling.top_k), np.float32(sampling.top_p))
        next_tokens, cache, positions = self._prefill(params, contexts, rows, key, 0, scalars)
        done = np.zeros(count, bool)
        for index in range(num_tokens):
            more = index + 1 < num_tokens
            pending = None
            if more and int(positions.max()) < self.max_len:
                # The next step is queued before this one's tokens are read: the devices never
                # wait for the host.
                pending = self.run("decode", params, cache, next_tokens, positions, rows, key, np.int32(index + 1),
                                   *scalars)
            host = np.asarray(next_tokens)
            live = np.flatnonzero(~done)
            yield Chunk(index, live, host[live].astype(np.int32))
            if eos_id is not None:
                done |= host[:count] == eos_id
                if done.all():
                    return
            if not more:
                return
            if pending is not None:
                next_tokens, cache, _ = pending
                positions = positions + 1
                if shift_context:
                    for context, token in zip(contexts, host.tolist()):
                        context.append(token)
            else:   # shift_context (check_request refuses the rest): go on from the last half
                keep = max(1, self.context // 2)
                contexts = [(context + [token])[-keep:] for context, token in zip(contexts, host.tolist())]
                next_tokens, cache, positions = self._prefill(params, contexts, rows, key, index + 1, scalars)

    def generate(self, params, prompts, num_tokens: int, sampling: Sampling = Sampling(), eos_id: int | None = None,
                 shift_context: bool = False) -> list[np.ndarray]:
        """Every prompt's completion (int32 [n_i], n_i <= num_tokens: shorter if it ended at eos_id)."""
        out: list[list[int]] = [[] for _ in prompts]
        for chunk in self.stream(params, prompts, num_tokens, sampling, eos_id, shift_context):
            for row, token in zip(chunk.rows.tolist(), chunk.tokens.tolist()):
                out[row].append(token)
        return [np.array(tokens, np.int32) for tokens in out]


@functools.lru_cache(maxsize=8)
def decoder(config: ModelConfig, max_len: int | None = None) -> Decoder:
    """The single-device Decoder of a config (compiled once per shape)."""
    return Decoder(config, max_len)
