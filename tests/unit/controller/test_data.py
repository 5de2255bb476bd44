"""The data pipeline: batches are a function of (seed, step) only."""
import pathlib

import numpy as np
import pytest

from multipod.controller.data import Batches, DataError, corpus_files, decode_tokens, encode_text, load_corpus, shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text("hello world, " * 400)
    (root / "b.txt").write_text("the quick brown fox " * 400)
    return root


def test_batch_depends_only_on_seed_and_step(corpus):
    tokens = load_corpus(str(corpus))
    one = Batches(tokens, seq_len=16, global_batch=4, seed=3)
    two = Batches(tokens, seq_len=16, global_batch=4, seed=3)
    # Asking in another order, or skipping steps, gives the same batch for a step.
    later = two.batch(7)
    assert np.array_equal(one.batch(7), later)
    assert not np.array_equal(one.batch(7), one.batch(8))
    assert not np.array_equal(one.batch(7), Batches(tokens, 16, 4, seed=4).batch(7))
    batch = one.batch(0)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < 256


def test_eval_batches_come_from_the_held_out_tail(corpus):
    tokens = load_corpus(str(corpus))
    batches = Batches(tokens, 8, 2, seed=0)
    held_out = bytes(batches.eval.astype(np.uint8))
    for row in batches.eval_batch(0):
        assert bytes(row.astype(np.uint8)) in held_out


def test_default_corpus_is_the_stdlib():
    files = corpus_files("")
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)


def test_shard_splits_evenly():
    batch = np.arange(24, dtype=np.int32).reshape(6, 4)
    parts = shard(batch, 2)
    assert [p.shape for p in parts] == [(3, 4), (3, 4)]
    assert np.array_equal(np.concatenate(parts), batch)
    with pytest.raises(DataError):
        shard(batch, 4)


def test_errors(tmp_path):
    with pytest.raises(DataError, match="neither"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(DataError, match="seq_len"):
        Batches(load_corpus(str(tmp_path / "tiny.txt")), 16, 2, 0)


def test_the_loader_reports_what_it_read_and_what_it_skipped(tmp_path, monkeypatch, capsys):
    from multipod.controller import data
    root = tmp_path / "corpus"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("[core]\n")       # inside a hidden directory
    (root / ".notes").write_text("private\n")
    (root / "a.txt").write_text("a" * 600)
    (root / "b.bin").write_bytes(b"\x00\x01" * 100)         # binary: a NUL byte
    (root / "c.txt").write_text("c" * 50)                   # unreadable, below
    (root / "d.txt").write_text("d" * 600)                  # reaches the cap: the last file read
    (root / "e.txt").write_text("e" * 700)
    (root / "f.txt").write_text("f" * 800)
    monkeypatch.setattr(data, "MAX_CORPUS_BYTES", 1000)
    read_bytes = pathlib.Path.read_bytes

    def unreadable_c(self):
        if self.name == "c.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)
    monkeypatch.setattr(pathlib.Path, "read_bytes", unreadable_c)

    tokens = load_corpus(str(root))
    assert bytes(tokens) == b"a" * 600 + b"\0" + b"d" * 600 + b"\0"
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"corpus {root}: read 2 file(s) (1.2 KiB); skipped 6 file(s) (1.7 KiB): "), line
    assert "2 over the 1000 B cap: e.txt, f.txt" in line
    assert "1 unreadable: c.txt (Permission denied)" in line
    assert "1 not text (contain NUL bytes): b.bin" in line
    assert "2 hidden: .git/config, .notes" in line

    _, report = data.read_corpus(str(root))
    assert (report.files_read, report.bytes_read) == (2, 1200)
    skipped = {why: (s.files, s.bytes) for why, s in report.skipped.items()}
    assert skipped == {data.HIDDEN: (2, 15), data.NOT_TEXT: (1, 200), data.UNREADABLE: (1, 50),
                       "over the 1000 B cap": (2, 1500)}


def test_a_corpus_without_text_is_refused_with_the_reason(tmp_path):
    (tmp_path / "image.bin").write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match=r"no text to train on: .*1 not text .*image\.bin"):
        load_corpus(str(tmp_path))


def test_the_default_corpus_skips_nothing(capsys):
    tokens = load_corpus("")
    line = capsys.readouterr().out
    assert line.strip().endswith("; nothing skipped") and f"read {len(corpus_files('')):,} file(s)" in line
    assert tokens.size > 1 << 20


def test_text_round_trip():
    assert decode_tokens(encode_text("def f(x):")) == "def f(x):"


def test_tokens_travel_as_the_narrowest_dtype_that_holds_the_vocabulary():
    from multipod.controller.data import Prefetcher, narrow, token_dtype
    from multipod.protos import codec
    assert token_dtype(256) == np.uint8 and token_dtype(200) == np.uint8
    assert token_dtype(257) == (np.uint16 if "uint16" in codec.DTYPES else np.int32)
    assert token_dtype(1 << 17) == np.int32
    tokens = np.array([[0, 255], [7, 1]], np.int32)
    assert narrow(tokens).dtype == np.uint8 and (narrow(tokens) == tokens).all()
    with pytest.raises(DataError):
        narrow(np.array([[256]], np.int32), np.uint8)

    class Batches:
        def batch(self, index):
            return np.full((4, 9), index, np.int32)
    prefetch = Prefetcher(Batches(), 2, 0, 1, dtype=np.uint8)
    try:
        step, shards = prefetch.next(10)
    finally:
        prefetch.close()
    decoded = [codec.decode(s) for s in shards]
    assert step == 0 and [d.dtype for d in decoded] == [np.uint8] * 2 and [d.shape for d in decoded] == [(2, 9)] * 2
