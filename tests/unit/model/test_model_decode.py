"""Decoding with the KV cache (model/decode.py): the same tokens and logits as the model without a
cache, batched prompts of different lengths as each alone, the sampler's options, stopping and
refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from multipod.model import Decoder, Sampling, Transformer, generate, loss_sums
from multipod.model.decode import decode_step, filter_logits, init_cache, prefill

PERIOD = np.random.RandomState(5).permutation(256)[:11].astype(np.int32)   # the pattern the model learns


def _pattern(offset: int, length: int) -> np.ndarray:
    return np.resize(np.roll(PERIOD, -offset), length).astype(np.int32)


@pytest.fixture(scope="module")
def trained(tiny_config):
    """Params trained for a few steps to continue PERIOD, so greedy decisions have clear margins."""
    from multipod.model import init_params
    params = init_params(tiny_config, seed=0)
    tx = optax.adam(1e-2)
    state = tx.init(params)
    length = tiny_config.max_seq_len + 1
    batch = np.stack([_pattern(o, length) for o in range(11)])

    @jax.jit
    def step(params, state):
        def loss(p):
            ce, z = loss_sums(p, batch, tiny_config)
            return (ce + z) / batch[:, 1:].size
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    for _ in range(150):
        params, state, value = step(params, state)
    assert float(value) < 0.5, f"the fixture did not learn the pattern (loss {float(value):.3f})"
    return params


@pytest.fixture(scope="module")
def decoder(tiny_config):
    return Decoder(tiny_config)


def _random_prompt(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, size=n).astype(np.int32)


PROMPTS = [_pattern(0, 3), _pattern(4, 7), _pattern(9, 1), _random_prompt(5, 1), _random_prompt(12, 2)]


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_with_the_cache_equals_greedy_without_it(tiny_config, trained, decoder, index):
    prompt = PROMPTS[index]
    n = tiny_config.max_seq_len - len(prompt)
    with_cache = decoder.generate(trained, [prompt], n)[0]
    without = generate(trained, tiny_config, prompt, n, temperature=0.0, seed=0)
    np.testing.assert_array_equal(with_cache, without)
    if index < 3:    # a prompt from the pattern: the model continues it
        offset = int(np.flatnonzero(PERIOD == prompt[0])[0])
        np.testing.assert_array_equal(with_cache, _pattern(offset + len(prompt), n))


def test_cached_logits_equal_the_full_forward_pass(tiny_config, trained):
    prompt, length = _random_prompt(6, 3), tiny_config.max_seq_len
    tokens = np.concatenate([prompt, _random_prompt(length - 6, 4)])
    full = np.asarray(Transformer(tiny_config).apply({"params": trained}, tokens[None]))[0]
    cache = init_cache(tiny_config, 1, length)
    run_prefill, run_decode = jax.jit(prefill, static_argnums=1), jax.jit(decode_step, static_argnums=1)
    logits, cache = run_prefill(trained, tiny_config, cache, jnp.asarray(prompt[None]), jnp.array([6]))
    np.testing.assert_allclose(np.asarray(logits)[0], full[5], rtol=1e-5, atol=1e-5)
    for position in range(6, length):
        logits, cache = run_decode(trained, tiny_config, cache, jnp.asarray(tokens[position:position + 1]),
                                    jnp.array([position]))
        np.testing.assert_allclose(np.asarray(logits)[0], full[position], rtol=1e-5, atol=1e-5)


def test_batched_prompts_of_different_lengths_equal_each_alone(tiny_config, trained, decoder):
    n = tiny_config.max_seq_len - max(len(p) for p in PROMPTS)
    batched = decoder.generate(trained, PROMPTS, n)
    for prompt, out in zip(PROMPTS, batched):
        np.testing.assert_array_equal(out, decoder.generate(trained, [prompt], n)[0])
    assert not np.array_equal(batched[0], batched[1][:len(batched[0])])


def test_top_k_1_and_a_tiny_nucleus_are_greedy(trained, decoder):
    greedy = decoder.generate(trained, PROMPTS[3:], 4)
    for sampling in (Sampling(temperature=1.5, top_k=1, seed=3), Sampling(temperature=1.5, top_p=1e-6, seed=3)):
        for a, b in zip(decoder.generate(trained, PROMPTS[3:], 4, sampling), greedy):
            np.testing.assert_array_equal(a, b)


def test_sampling_is_deterministic_per_seed_and_row(trained, decoder):
    prompt = _random_prompt(4, 7)
    hot = lambda seed, **kw: decoder.generate(trained, [prompt, prompt], 10, Sampling(temperature=3.0, seed=seed, **kw))
    a, b, c = hot(7), hot(7), hot(8)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], a[1])      # each row draws with its own key
    # A row's draws depend on (seed, row, position), not on the rows beside it.
    np.testing.assert_array_equal(decoder.generate(trained, [prompt], 10, Sampling(temperature=3.0, seed=7))[0], a[0])
    np.testing.assert_array_equal(hot(7, top_k=5)[0], hot(7, top_k=5)[0])


def test_filter_logits_keeps_the_top_k_then_the_nucleus():
    logits = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda k, p: np.flatnonzero(np.isfinite(np.asarray(filter_logits(logits, jnp.int32(k), jnp.float32(p))[0])))
    assert kept(0, 1.0).tolist() == [0, 1, 2, 3, 4]
    assert kept(2, 1.0).tolist() == [1, 3]
    assert kept(0, 0.5).tolist() == [1, 3]          # 0.4 < 0.5: the second most likely is needed too
    assert kept(0, 0.4).tolist() == [1]
    assert kept(0, 0.75).tolist() == [1, 3, 4]
    assert kept(3, 0.95).tolist() == [1, 3, 4]      # top-k first, then the nucleus of what is left


def test_a_row_stops_after_the_end_token_and_the_stream_goes_on_for_the_others(trained, decoder):
    a, b = _pattern(0, 3), _pattern(5, 2)
    eos = int(_pattern(3, 3)[2])       # the third token a's completion emits
    chunks = list(decoder.stream(trained, [a, b], 8, eos_id=eos))
    assert [c.index for c in chunks] == list(range(8))
    out = decoder.generate(trained, [a, b], 8, eos_id=eos)
    np.testing.assert_array_equal(out[0], _pattern(3, 3))
    assert all(0 not in c.rows.tolist() for c in chunks[3:]) and all(1 in c.rows.tolist() for c in chunks)
    assert len(out[1]) == 8 or out[1][-1] == eos


def test_shift_context_goes_past_max_seq_len(tiny_config, trained, decoder):
    prompt = _pattern(0, 4)
    limit = tiny_config.max_seq_len - 4
    long = decoder.generate(trained, [prompt], 30, shift_context=True)[0]
    assert len(long) == 30
    np.testing.assert_array_equal(long[:limit], decoder.generate(trained, [prompt], limit)[0])
    np.testing.assert_array_equal(long, _pattern(4, 30))     # the pattern carries on after the shift


@pytest.mark.parametrize("prompts, num_tokens, sampling, match", [
    ([np.zeros(17, np.int32)], 1, Sampling(), "17 tokens, more than the model's context of 16"),
    ([np.zeros(5, np.int32)], 12, Sampling(), r"5 tokens\) \+ 12 new tokens = 17 exceed .* at most 11"),
    ([np.zeros(3, np.int32), np.zeros(0, np.int32)], 1, Sampling(), "prompt 1 is empty"),
    ([np.array([3, 256])], 1, Sampling(), r"token ids must be in \[0, 256\)"),
    ([np.array([3])], 1, Sampling(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ([np.array([3])], 1, Sampling(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ([np.array([3])], 1, Sampling(temperature=-1.0), "temperature"),
    ([], 1, Sampling(), "no prompt"),
])
def test_bad_requests_are_refused_before_anything_runs(trained, decoder, prompts, num_tokens, sampling, match):
    with pytest.raises(ValueError, match=match):
        decoder.stream(trained, prompts, num_tokens, sampling)
