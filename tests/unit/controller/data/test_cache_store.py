"""The data cache (controller/data/cache_store.py, `multipod cache`): every run marks what it
uses, `list` shows each entry with its size and age, and `prune` removes what no run has used for
the days asked, leaves the rest and a build that may still be running, and a dry run removes
nothing."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

from multipod import cli
from multipod.controller.core.run_config import load_config
from multipod.controller.data import cache_store, corpus

DAY = 86400.0


def _age(path, days: float) -> None:
    """Make `path` look last used `days` ago."""
    then = time.time() - days * DAY
    os.utime(path, (then, then))


@pytest.fixture
def prepared(tmp_path):
    """A corpus prepared once with a trained BPE: a cache holding one tokenizer and one token cache."""
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    root = tmp_path / "cache"
    config = load_config(None, [f'data.path="{source}"', 'data.tokenizer="bpe:300"', f'data.cache_dir="{root}"',
                                "data.seq_len=16", "data.global_batch=2", "model.max_seq_len=16"])
    corpus.prepare(config, progress=False)
    return config, root


def test_a_run_marks_the_tokenizer_and_the_token_cache_it_reuses_as_used(prepared):
    config, root = prepared
    found = cache_store.entries(root)
    assert sorted(e.kind for e in found) == ["tokenizer", "tokens"]
    for entry in found:
        _age(entry.path, 40)
    assert all(e.age_days(time.time()) > 39 for e in cache_store.entries(root))
    corpus.prepare(config, progress=False)      # reuses both
    assert all(e.age_days(time.time()) < 1 for e in cache_store.entries(root))


def test_list_names_each_entry_its_source_and_its_size(prepared, capsys):
    config, root = prepared
    tokens = next(e for e in cache_store.entries(root) if e.kind == "tokens")
    assert str(config.data.path) in tokens.describes and "tokenizer" in tokens.describes
    assert tokens.size_bytes == sum(f.stat().st_size for f in tokens.path.iterdir())
    assert cli.main(["cache", "list", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert str(tokens.path) in out and "2 entries" in out
    assert "data.max_bytes" not in tokens.describes
    # A capped source's cache says so, beside the whole source's (data.max_bytes).
    capped = dataclasses.replace(config, data=dataclasses.replace(config.data, max_bytes=100))
    corpus.prepare(capped, progress=False)
    described = [e.describes for e in cache_store.entries(root) if e.kind == "tokens"]
    assert sorted("data.max_bytes" in d for d in described) == [False, True], described
    assert any("(its first 100 bytes: data.max_bytes)" in d for d in described)


def test_prune_removes_only_what_no_run_used_for_the_days_asked(prepared, capsys):
    _, root = prepared
    by_kind = {e.kind: e for e in cache_store.entries(root)}
    tokens, tokenizer = by_kind["tokens"], by_kind["tokenizer"]
    _age(tokens.path, 10)
    _age(tokenizer.path, 2)
    # A build folder that a killed process left, and one that a build running elsewhere may still write to.
    abandoned, running = root / "tokens" / ".abc.tmp-1", root / "tokens" / ".abc.tmp-2"
    for folder in (abandoned, running):
        folder.mkdir()
        (folder / "train-00000.bin").write_bytes(b"\0" * 64)
    _age(abandoned, 0.5)

    assert cli.main(["cache", "prune", "--cache-dir", str(root), "--older-than-days", "5", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out
    assert all(p.exists() for p in (tokens.path, tokenizer.path, abandoned, running))     # a dry run keeps all

    assert cli.main(["cache", "prune", "--cache-dir", str(root), "--older-than-days", "5"]) == 0
    out = capsys.readouterr().out
    assert str(tokens.path) in out and "1 entry" in out
    assert not tokens.path.exists() and tokenizer.path.exists()

    gone = cache_store.prune(root, 0)
    assert {e.path for e in gone} == {tokenizer.path, abandoned}
    assert running.exists() and not tokenizer.path.exists() and not abandoned.exists()


def test_bad_arguments_name_the_option(tmp_path, capsys):
    assert cli.main(["cache", "prune", "--cache-dir", str(tmp_path), "--older-than-days", "-1"]) == 2
    assert "--older-than-days: must be 0 or more" in capsys.readouterr().err
    assert cli.main(["cache", "list", "--cache-dir", str(tmp_path / "missing")]) == 2
    assert f"--cache-dir: {tmp_path / 'missing'} is not a directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="older-than-days must be 0 or more"):
        cache_store.prune(tmp_path, float("nan"))


def test_the_compilation_cache_is_listed_by_its_last_read_and_pruned_with_the_rest(prepared, capsys):
    _, root = prepared
    compiled = root / "jax"     # as jax's bounded cache writes it: a program and its last-read time
    compiled.mkdir()
    program, read = compiled / "jit_step-abc-cache", compiled / "jit_step-abc-atime"
    program.write_bytes(b"\0" * 1000)
    read.write_bytes(b"\0" * 8)
    for path in (compiled, program):
        _age(path, 30)
    _age(read, 3)                # read 3 days ago, written 30 days ago
    entry = next(e for e in cache_store.entries(root) if e.kind == "compiled programs")
    assert entry.path == compiled and entry.size_bytes == 1008 and 2.9 < entry.age_days(time.time()) < 3.1
    assert cli.main(["cache", "list", "--cache-dir", str(root)]) == 0
    assert f"compiled programs {compiled}" in capsys.readouterr().out
    assert compiled not in {e.path for e in cache_store.prune(root, 5)} and compiled.exists()
    assert compiled in {e.path for e in cache_store.prune(root, 2)} and not compiled.exists()
