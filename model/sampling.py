"""Autoregressive sampling with a fixed window and no KV cache: the reference that decoding with
the cache (decode.py) is tested against (greedy output must be the same).

Every step runs the model on a [1, max_seq_len] window holding the last max_seq_len
context tokens, left-aligned and zero-padded on the right. Causal attention means the
padding never affects the logits read at the last real position, and a fixed window
shape means exactly one compile per config.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from multipod.model.config import ModelConfig
from multipod.model.transformer import Transformer


@functools.lru_cache(maxsize=8)
def _step_fn(config: ModelConfig):
    """Jitted (params, window, last_pos, key, temperature) -> next token, per config."""
    model = Transformer(config)

    def step(params, window, last_pos, key, temperature):
        logits = model.apply({"params": params}, window)[0, last_pos]
        greedy = jnp.argmax(logits).astype(jnp.int32)
        # The max() only guards the unused branch against dividing by zero.
        scaled = logits / jnp.maximum(temperature, 1e-6)
        sampled = jax.random.categorical(key, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    return jax.jit(step)


def generate(params, config: ModelConfig, prompt: np.ndarray, num_tokens: int,
             temperature: float, seed: int) -> np.ndarray:
    """Sample `num_tokens` tokens after `prompt` (int32 [P], P >= 1); returns int32 [num_tokens].

    temperature 0 is greedy (argmax); otherwise tokens are drawn from softmax(logits / T).
    Deterministic given `seed`. Contexts longer than max_seq_len are left-truncated.
    """
    config.validate()
    prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt must contain at least one token")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be non-negative, got {temperature}")

    step = _step_fn(config)
    window_len = config.max_seq_len
    key = jax.random.PRNGKey(seed)
    temp = jnp.float32(temperature)
    context = list(prompt)
    out = np.zeros(num_tokens, dtype=np.int32)
    for i in range(num_tokens):
        visible = context[-window_len:]
        window = np.zeros((1, window_len), dtype=np.int32)
        window[0, : len(visible)] = visible
        token = step(params, window, np.int32(len(visible) - 1),
                     jax.random.fold_in(key, i), temp)
        out[i] = int(token)
        context.append(out[i])
    return out
