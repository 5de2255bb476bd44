"""Packed sequences, one permutation per epoch: every train sequence once per epoch, a batch a
function of (seed, step) only, eval in order."""
import dataclasses
import pathlib

import numpy as np
import pytest

from multipod.controller.data.batches import DataError
from multipod.controller.data.dataset import TokenDataset
from multipod.controller.data.token_cache import open_cache
from multipod.controller.data.tokenizer import ByteTokenizer

L = 4   # seq_len


class Stream:
    """A token stream whose token at position p is p + base: a row tells which sequence it is."""

    def __init__(self, size: int, base: int = 0):
        self.tokens = np.arange(base, base + size, dtype=np.int64)

    def __len__(self):
        return self.tokens.size

    def read(self, start, length):
        assert 0 <= start and start + length <= self.tokens.size
        return self.tokens[start:start + length]


@dataclasses.dataclass
class Cache:
    train: Stream
    eval: Stream
    text_bytes: dict
    directory: pathlib.Path = pathlib.Path("/cache/key")


def make(train_sequences=12, eval_sequences=5, global_batch=4, seed=0, extra=0):
    # n sequences need n * L + 1 tokens; `extra` tokens short of another sequence change nothing.
    cache = Cache(Stream(train_sequences * L + 1 + extra), Stream(eval_sequences * L + 1, base=10_000),
                  {"train": 0, "eval": 3 * (eval_sequences * L + 1)})
    return TokenDataset(cache, L, global_batch, seed)


def sequence_ids(batch):
    assert batch.dtype == np.int32 and batch.shape[1] == L + 1
    # The row of sequence i is tokens i*L .. i*L + L: inputs and targets share the boundary token.
    assert (batch == batch[:, :1] + np.arange(L + 1)).all()
    assert (batch[:, 0] % L == 0).all()
    return list(batch[:, 0] // L)


@pytest.mark.parametrize("global_batch", [4, 5])   # divides 12 sequences, and does not
def test_every_train_sequence_once_per_epoch(global_batch):
    data = make(train_sequences=12, global_batch=global_batch, extra=L - 1)
    assert data.num_train_sequences == 12
    epochs = 5
    rows = [s for step in range(epochs * 12 // global_batch) for s in sequence_ids(data.batch(step))]
    assert len(rows) == epochs * 12
    orders = [rows[e * 12:(e + 1) * 12] for e in range(epochs)]
    for order in orders:
        assert sorted(order) == list(range(12))
    assert len({tuple(o) for o in orders}) == epochs      # a fresh order each epoch
    assert len(data._permutations) <= 2                    # only the last epochs' are kept


def test_a_batch_depends_only_on_seed_and_step():
    one = make(seed=7)
    forward = [one.batch(s) for s in range(9)]
    two = make(seed=7)
    backward = [two.batch(s) for s in reversed(range(9))][::-1]
    assert all(np.array_equal(a, b) for a, b in zip(forward, backward))
    assert np.array_equal(make(seed=7).batch(5), forward[5])          # asked first, on a new instance
    other = make(seed=8)
    assert any(not np.array_equal(other.batch(s), forward[s]) for s in range(9))
    # The documented rule, spelled out: permutation(seed, epoch)[position].
    assert sequence_ids(forward[4]) == list(np.random.default_rng([7, 1]).permutation(12)[4:8])


def test_epochs_count_completed_passes():
    data = make(train_sequences=12, global_batch=4)
    assert [data.epoch(s) for s in (0, 1, 2, 5)] == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0, 2.0]


def test_eval_batches_are_the_held_out_sequences_in_order():
    data = make(eval_sequences=5, global_batch=2)
    assert data.num_eval_sequences == 5 and data.num_eval_batches == 2
    first = data.eval_batch(0)
    assert first.dtype == np.int32 and (first[:, 0] == [10_000, 10_000 + L]).all()
    assert list((data.eval_batch(2)[:, 0] - 10_000) // L) == [4, 0]      # wraps around
    assert data.eval_bytes_per_token == 3.0
    assert make(eval_sequences=1, global_batch=4).num_eval_batches == 1


def test_splits_too_small_are_errors_naming_the_split():
    with pytest.raises(DataError, match=r"train split of token cache /cache/key has 45 tokens: 11 sequences "
                                        r"of seq_len 4, fewer than the global batch of 12"):
        make(train_sequences=11, global_batch=12)
    with pytest.raises(DataError, match=r"eval split of token cache /cache/key has 1 tokens: no sequence"):
        make(eval_sequences=0)


def test_on_a_real_cache(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(60):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"document number {i} " * 3)
    cache = open_cache(str(tmp_path / "docs"), ByteTokenizer(), tmp_path / "cache", progress=False)
    data = TokenDataset(cache, seq_len=16, global_batch=8, seed=1)
    stream = cache.train.read(0, len(cache.train)).astype(np.uint8).tobytes()
    batch = data.batch(3)
    assert batch.shape == (8, 17) and batch.dtype == np.int32
    for row in batch:
        assert row.astype(np.uint8).tobytes() in stream
    assert data.eval_batch(0)[0].astype(np.uint8).tobytes() == b"document number 49 document number 49 "[:17]
    assert data.eval_bytes_per_token == pytest.approx(cache.text_bytes["eval"] / len(cache.eval))
    assert data.eval_bytes_per_token < 1      # the EOS tokens carry no text
