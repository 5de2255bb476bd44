"""The token cache: built once, reused while the source and tokenizer hold, rebuilt when either
changes; EOS after every document; the held-out split; shards; no half cache after a crash."""
import json
import os
import pathlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from multipod.controller.data import sources, token_cache
from multipod.controller.data.batches import DataError
from multipod.controller.data.token_cache import EVAL_EVERY, open_cache
from multipod.controller.data.tokenizer import ByteTokenizer

DOCS = [f"doc {i}: " + "abcdefgh"[i % 8] * (i % 13) + "\n" for i in range(2 * EVAL_EVERY + 7)]


def tokens(stream) -> bytes:
    return stream.read(0, len(stream)).astype(np.uint8).tobytes()


def joined(texts) -> bytes:
    return b"".join(t.encode() + b"\0" for t in texts)     # ByteTokenizer's EOS is 0


def open_quiet(path, root, tokenizer=None, **kwargs):
    return open_cache(str(path), tokenizer or ByteTokenizer(), root, progress=False, **kwargs)


@pytest.fixture
def folder(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(DOCS):
        (folder / f"{i:03d}.txt").write_text(text)
    return folder


def test_documents_end_with_eos_and_every_50th_is_held_out(folder, tmp_path):
    cache = open_quiet(folder, tmp_path / "cache")
    held = [i for i in range(len(DOCS)) if i % EVAL_EVERY == EVAL_EVERY - 1]
    assert held == [49, 99]
    assert tokens(cache.eval) == joined(DOCS[i] for i in held)
    assert tokens(cache.train) == joined(d for i, d in enumerate(DOCS) if i not in held)
    assert cache.documents == {"train": len(DOCS) - 2, "eval": 2}
    assert cache.text_bytes == {"eval": sum(len(DOCS[i]) for i in held),
                                "train": sum(len(d) for i, d in enumerate(DOCS) if i not in held)}
    assert cache.dtype == np.uint16 and cache.train.read(0, 3).dtype == np.uint16
    index = json.loads((cache.directory / "index.json").read_text())
    assert index["tokenizer"]["fingerprint"] == ByteTokenizer.fingerprint and index["source"] == str(folder)
    assert index["splits"]["eval"]["tokens"] == len(cache.eval) and "nothing skipped" in index["report"]


def test_jsonl_and_parquet_give_the_same_tokens_as_text_files(folder, tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet, row_group_size=10)
    caches = [open_quiet(p, tmp_path / "cache") for p in (folder, jsonl, parquet)]
    assert len({c.directory for c in caches}) == 3
    for split in ("train", "eval"):
        assert len({tokens(getattr(c, split)) for c in caches}) == 1
    assert len({json.dumps([c.documents, c.text_bytes]) for c in caches}) == 1


def test_built_once_then_reused_without_reading_the_source(folder, tmp_path, monkeypatch, capsys):
    first = open_quiet(folder, tmp_path / "cache")
    assert first.built
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"token cache: built {first.directory} (")
    monkeypatch.setattr(sources, "iter_documents", lambda *a, **k: pytest.fail("the source was read"))
    again = open_quiet(folder, tmp_path / "cache")
    assert not again.built and again.directory == first.directory
    assert tokens(again.train) == tokens(first.train) and again.report_summary == first.report_summary
    out = capsys.readouterr().out.splitlines()
    assert out == [first.report_summary, f"token cache: reusing {first.directory} ({first.describe()})"]
    assert first.describe() == f"{len(first.train):,} train tokens, {len(first.eval)} eval tokens, 107 documents"


def test_rebuilt_when_a_file_changes_or_is_added_or_the_tokenizer_changes(folder, tmp_path):
    root = tmp_path / "cache"
    first = open_quiet(folder, root)
    file = folder / "003.txt"
    stat = file.stat()
    file.write_text(DOCS[3].upper())                        # same size, other content, later mtime
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = open_quiet(folder, root)
    assert changed.built and changed.directory != first.directory
    assert DOCS[3].upper().encode() in tokens(changed.train)
    (folder / "999.txt").write_text("a new file")
    added = open_quiet(folder, root)
    assert added.built and tokens(added.train).endswith(b"a new file\0")

    class OtherBytes(ByteTokenizer):
        fingerprint = "another tokenizer"
    other = open_quiet(folder, root, OtherBytes())
    assert other.built and other.directory not in (first.directory, changed.directory, added.directory)
    assert not open_quiet(folder, root).built


def test_shards_split_at_the_size_limit_and_reads_cross_them(folder, tmp_path):
    cache = open_quiet(folder, tmp_path / "cache", shard_tokens=7)
    expected = joined(d for i, d in enumerate(DOCS) if i % EVAL_EVERY != EVAL_EVERY - 1)
    files = sorted(cache.directory.glob("train-*.bin"))
    assert len(files) == -(-len(expected) // 7) and files[0].name == "train-00000.bin"
    assert all(f.stat().st_size == 7 * 2 for f in files[:-1]) and 0 < files[-1].stat().st_size <= 14
    assert tokens(cache.train) == expected
    for start, length in [(0, 7), (5, 3), (6, 1), (7, 0), (3, 30), (len(expected) - 9, 9)]:
        assert cache.train.read(start, length).astype(np.uint8).tobytes() == expected[start:start + length]
    with pytest.raises(IndexError):
        cache.train.read(len(expected) - 2, 3)


def test_a_single_file_holds_out_the_tail_of_its_tokens(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 999)
    cache = open_quiet(tmp_path / "one.txt", tmp_path / "cache")
    # 999 bytes + EOS = 1000 tokens: the last 1000 // 50 = 20 (19 of text and the EOS) are eval.
    assert (len(cache.train), len(cache.eval)) == (980, 20)
    assert tokens(cache.eval) == b"x" * 19 + b"\0"
    assert cache.documents == {"train": 1, "eval": 0} and cache.text_bytes == {"train": 980, "eval": 19}


def test_a_crash_mid_build_leaves_nothing_that_is_reused(folder, tmp_path):
    class Crashing(ByteTokenizer):     # the same fingerprint: a crash must not leave its key behind
        calls = 0

        def encode_batch(self, texts):
            self.calls += 1
            if self.calls == 3:
                assert list((root / "tokens").glob(".*.tmp-*/train-00000.bin")), "shards are being written"
                raise RuntimeError("tokenizer crashed")
            return super().encode_batch(texts)
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="crashed"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(token_cache, "ENCODE_BATCH", 10)
        open_quiet(folder, root, Crashing())
    assert list((root / "tokens").iterdir()) == []
    # A cache killed before its index (or left without one) is never taken as complete.
    key = token_cache.cache_key(str(folder), ByteTokenizer())
    (root / "tokens" / key).mkdir()
    (root / "tokens" / key / "train-00000.bin").write_bytes(b"\1\0" * 5)
    cache = open_quiet(folder, root)
    assert cache.built and tokens(cache.train).startswith(DOCS[0].encode())
    # A shard truncated after the fact: rebuilt, not read short.
    os.truncate(cache.directory / "train-00000.bin", 10)
    assert open_quiet(folder, root).built
    (cache.directory / "eval-00000.bin").unlink()
    rebuilt = open_quiet(folder, root)
    assert rebuilt.built and tokens(rebuilt.eval) == joined([DOCS[49], DOCS[99]])


def test_another_process_publishing_first_wins(folder, tmp_path, monkeypatch):
    rename = os.rename

    def race(src, dst):     # the other process renames its finished cache into place just before us
        shutil.copytree(src, dst)
        rename(src, dst)
    monkeypatch.setattr(token_cache.os, "rename", race)
    cache = open_quiet(folder, tmp_path / "cache")
    assert cache.built and tokens(cache.eval) == joined([DOCS[49], DOCS[99]])
    assert [p.name for p in (tmp_path / "cache" / "tokens").iterdir()] == [cache.directory.name]


def test_large_vocabularies_use_uint32(folder, tmp_path):
    class Wide(ByteTokenizer):
        vocab_size, fingerprint = 70_000, "wide"
    cache = open_quiet(folder, tmp_path / "cache", Wide())
    assert cache.dtype == np.uint32 and tokens(cache.eval) == joined([DOCS[49], DOCS[99]])


def test_bad_sources_and_tokenizers_are_errors_naming_them(tmp_path):
    (tmp_path / "image.bin").write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match=rf"corpus {tmp_path}: read 0 file.*1 not text .*image\.bin"):
        open_quiet(tmp_path, tmp_path / "cache")
    (tmp_path / "image.bin").unlink()
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: an empty jsonl"):
        open_quiet(tmp_path / "empty.jsonl", tmp_path / "cache")

    class Small(ByteTokenizer):
        vocab_size, fingerprint = 100, "small"
    (tmp_path / "a.txt").write_text("z")
    with pytest.raises(DataError, match=r"gave id 122 outside its vocabulary of 100"):
        open_quiet(tmp_path / "a.txt", tmp_path / "cache", Small())
    assert [p for p in (tmp_path / "cache" / "tokens").iterdir()] == []


def test_a_progress_bar_only_on_a_terminal(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(token_cache.sys.stderr, "isatty", lambda: True, raising=False)
    assert open_cache(str(folder), ByteTokenizer(), tmp_path / "cache").built
    assert "token cache: built" in capsys.readouterr().out


def test_the_default_corpus_is_cached(tmp_path):
    cache = open_quiet("", tmp_path)
    assert len(cache.train) > 1 << 20 and sum(cache.documents.values()) == len(sources.corpus_files(""))
    assert pathlib.Path(cache.directory).parent == tmp_path / "tokens"


def test_a_trained_bpe_gives_the_same_tokens_from_every_format_and_ends_documents(folder, tmp_path):
    from multipod.controller.data.tokenizer import train_bpe
    bpe = train_bpe(DOCS, 300, tmp_path / "tokenizer.json")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet)
    caches = [open_quiet(p, tmp_path / "cache", bpe) for p in (folder, jsonl, parquet)]
    streams = [c.train.read(0, len(c.train)) for c in caches]
    assert all(np.array_equal(s, streams[0]) for s in streams)
    ids = streams[0].astype(np.int64)
    assert ids.max() < bpe.vocab_size and len(ids) < caches[0].text_bytes["train"]     # merges happened
    ends = np.flatnonzero(ids == bpe.eos_id)
    assert len(ends) == caches[0].documents["train"] and ends[-1] == len(ids) - 1
    documents = np.split(ids, ends[:-1] + 1)
    assert [bpe.decode(d[:-1]) for d in documents] == [d for i, d in enumerate(DOCS) if i % EVAL_EVERY != 49]
    assert not open_quiet(jsonl, tmp_path / "cache", bpe).built


def test_a_build_folder_left_by_a_killed_process_is_removed_by_the_next_build(folder, tmp_path):
    import time
    key = token_cache.cache_key(str(folder), ByteTokenizer())
    tokens_dir = tmp_path / "cache" / "tokens"
    tokens_dir.mkdir(parents=True)
    old = tokens_dir / f".{key}.tmp-abandoned"
    old.mkdir()
    (old / "train-00000.bin").write_bytes(b"\0" * 8)
    recent = tokens_dir / f".{key}.tmp-running"
    recent.mkdir()
    long_ago = time.time() - 2 * token_cache.ABANDONED_S
    for path in (old / "train-00000.bin", old):
        os.utime(path, (long_ago, long_ago))
    open_cache(str(folder), ByteTokenizer(), tmp_path / "cache", progress=False)
    assert not old.exists() and recent.exists()     # a build still running elsewhere is left alone
