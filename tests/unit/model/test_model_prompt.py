"""Prompt tuning in the model: the prefix of virtual tokens in the Transformer, the masked loss,
the prompt encoders, and decoding after a prefix (with the KV cache = without it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multipod.model import Decoder, Sampling, Transformer
from multipod.model.loss import prompted_loss_sums, token_losses
from multipod.model.prompt import PromptKind, init_prompt, prompt_embeddings, sampled_vocab_init


def _prefix(config, n=3, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (n, config.d_model)) * config.d_model ** -0.5


def test_a_prefix_changes_the_logits_after_it_and_none_changes_nothing(tiny_config, tiny_params):
    tokens = jnp.array([[5, 9, 2, 7, 1]], jnp.int32)
    plain = Transformer(tiny_config).apply({"params": tiny_params}, tokens)
    prefixed = Transformer(tiny_config).apply({"params": tiny_params}, tokens, prefix=_prefix(tiny_config))
    assert prefixed.shape == (1, 3 + 5, tiny_config.vocab_size)
    assert not np.allclose(prefixed[:, 3:], plain, atol=1e-4)
    again = Transformer(tiny_config).apply({"params": tiny_params}, tokens, prefix=None)
    assert np.array_equal(again, plain)


def test_the_masked_prompted_loss_counts_only_the_masked_targets(tiny_config, tiny_params):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 9)), jnp.int32)
    mask = jnp.asarray(np.array([[0, 0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 1]]), jnp.uint8)
    prefix = _prefix(tiny_config)
    ce, z = prompted_loss_sums(tiny_params, prefix, tokens, mask, tiny_config)
    logits = Transformer(tiny_config).apply({"params": tiny_params}, tokens[:, :-1], prefix=prefix)[:, 3:]
    want_ce, want_z = token_losses(logits, tokens[:, 1:], tiny_config.z_loss_weight)
    assert np.isclose(ce, float(jnp.sum(want_ce * mask)), rtol=1e-6)
    assert np.isclose(z, float(jnp.sum(want_z * mask)), rtol=1e-6)
    all_ce, _ = prompted_loss_sums(tiny_params, prefix, tokens, None, tiny_config)
    assert np.isclose(all_ce, float(jnp.sum(want_ce)), rtol=1e-6)


@pytest.mark.parametrize("kind", list(PromptKind))
def test_every_encoder_makes_virtual_tokens_from_the_seed_alone(kind):
    one = init_prompt(kind, 5, 16, 24, seed=3)
    two = init_prompt(kind, 5, 16, 24, seed=3)
    assert jax.tree.all(jax.tree.map(np.array_equal, one, two))
    out = prompt_embeddings(one, kind, 16, 24)
    assert out.shape == (5, 16) and bool(jnp.all(jnp.isfinite(out)))
    if kind == "prompt":
        assert np.array_equal(out, one["virtual"])     # prompt tuning: the embeddings are the parameters
    else:
        assert set(one) >= {"virtual", "hidden", "out"}  # p-tuning: an encoder in front of them
        assert (kind == "lstm") == ({"lstm_forward", "lstm_backward"} <= set(one))
    with pytest.raises(ValueError, match="not a valid PromptKind"):
        init_prompt("adapter", 5, 16, 24, seed=3)


def test_sampled_vocab_init_takes_rows_of_the_embedding(tiny_params):
    embedding = tiny_params["embedding"]
    virtual = np.asarray(sampled_vocab_init(embedding, 6, seed=2))
    rows = {tuple(np.asarray(r)) for r in np.asarray(embedding)}
    assert all(tuple(v) in rows for v in virtual)


def _greedy_without_cache(config, params, prefix, prompt, steps):
    # One program over a fixed length: the model is causal, so the padding after the tokens so
    # far does not change the logits read at the last of them.
    forward = jax.jit(lambda t: Transformer(config).apply({"params": params}, t, prefix=prefix))
    width = config.max_seq_len - prefix.shape[0]
    tokens = list(prompt)
    for _ in range(steps):
        row = np.zeros((1, width), np.int32)
        row[0, :len(tokens)] = tokens
        logits = forward(row)
        tokens.append(int(jnp.argmax(logits[0, prefix.shape[0] + len(tokens) - 1])))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def decoder(tiny_config):
    return Decoder(tiny_config, prefix_len=4)


def test_greedy_decoding_after_a_prefix_equals_the_model_without_a_cache(tiny_config, tiny_params, decoder):
    prefix = _prefix(tiny_config, n=4)
    prompts = [np.array([3, 8, 1], np.int32), np.array([200, 4, 4, 9, 12, 7], np.int32)]
    got = decoder.generate((tiny_params, prefix), prompts, 5)
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == _greedy_without_cache(tiny_config, tiny_params, prefix, prompt, 5)


def test_the_prefix_takes_its_positions_from_the_context(tiny_config, tiny_params, decoder):
    prompt = [np.arange(1, 9, dtype=np.int32)]     # max_seq_len 16, 4 virtual tokens: 12 positions left
    assert len(decoder.generate((tiny_params, _prefix(tiny_config, n=4)), prompt, 4)[0]) == 4
    with pytest.raises(ValueError, match="context of 12"):
        decoder.check(prompt, 5, Sampling())
    with pytest.raises(ValueError, match="no room"):
        Decoder(tiny_config, prefix_len=16)
