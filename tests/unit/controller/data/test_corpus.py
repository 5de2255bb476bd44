"""The run's data (controller/data/corpus.py): the vocabulary follows the tokenizer, a bpe:N tokenizer is
trained once per corpus and reused, and a model too small for the tokenizer is refused."""
from __future__ import annotations

import dataclasses

import pytest

from multipod.controller.core.run_config import ConfigError, load_config
from multipod.controller.data import corpus
from multipod.controller.data.tokenizer import ByteTokenizer, TokenizerError


class Wide(ByteTokenizer):
    name, vocab_size = "wide.json", 4001


def test_the_vocab_follows_the_tokenizer_padded_to_a_multiple_of_128(capsys):
    config = load_config()
    assert corpus.resolve_vocab(config, Wide(), vocab_given=False).model.vocab_size == 4096
    assert "4,001 ids padded up to a multiple of 128" in capsys.readouterr().out
    assert corpus.resolve_vocab(config, ByteTokenizer(), vocab_given=False).model.vocab_size == 256


def test_a_vocab_the_user_gave_is_kept_if_it_holds_every_id():
    config = load_config(None, ["model.vocab_size=8192"])
    assert corpus.resolve_vocab(config, Wide(), vocab_given=True).model.vocab_size == 8192
    small = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=1000))
    with pytest.raises(TokenizerError, match="wide.json has 4,001 tokens, more than model.vocab_size = 1,000"):
        corpus.resolve_vocab(small, Wide(), vocab_given=True)


def test_bpe_is_trained_once_per_corpus_and_reused(tmp_path, capsys):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    (source / "b.py").write_text("class Point:\n    def __init__(self, x):\n        self.x = x\n" * 200)
    config = load_config(None, [f"data.path={str(source)!r}".replace("'", '"'), 'data.tokenizer="bpe:300"',
                                f"data.cache_dir={str(tmp_path / 'cache')!r}".replace("'", '"'),
                                "data.seq_len=16", "data.global_batch=2", "model.max_seq_len=16"])
    first = corpus.prepare(config, progress=False)
    assert "training a byte-level BPE of 300 tokens" in capsys.readouterr().out
    again = corpus.prepare(config, progress=False)
    assert "reusing the BPE" in capsys.readouterr().out
    assert again.tokenizer.fingerprint == first.tokenizer.fingerprint
    assert first.config.model.vocab_size == 384 and first.tokenizer.vocab_size <= 300
    text = "def add(a, b):\n    return a + b\n"
    assert first.tokenizer.decode(first.tokenizer.encode(text)) == text
    # A changed corpus gets its own tokenizer.
    (source / "c.py").write_text("import os\nprint(os.getcwd())\n" * 100)
    corpus.prepare(config, progress=False)
    assert "training a byte-level BPE" in capsys.readouterr().out


def test_the_whole_source_is_read_unless_data_max_bytes_caps_it(tmp_path, capsys):
    """No cap by default, whatever the source's size; data.max_bytes reads the files in order up to
    that size (the one that reaches it whole), says what it left out, and builds a cache of its own
    (neither is ever taken for the other); a negative cap is refused naming the field."""
    source = tmp_path / "corpus"
    source.mkdir()
    for name, letter in (("a.txt", "a"), ("b.txt", "b"), ("c.txt", "c")):
        (source / name).write_text((letter * 63 + "\n") * 64)        # 4 KiB each
    sets = [f"data.path={str(source)!r}".replace("'", '"'), 'data.tokenizer="bytes"',
            f"data.cache_dir={str(tmp_path / 'cache')!r}".replace("'", '"'),
            "data.seq_len=16", "data.global_batch=2", "model.max_seq_len=16"]
    whole = corpus.prepare(load_config(None, sets), progress=False)
    assert sum(whole.dataset.cache.documents.values()) == 3
    assert "nothing skipped" in capsys.readouterr().out
    capped = corpus.prepare(load_config(None, [*sets, "data.max_bytes=5000"]), progress=False)
    assert "skipped 1 file(s) (4.0 KiB): 1 over the data.max_bytes cap of 4.9 KiB: c.txt" in capsys.readouterr().out
    assert sum(capped.dataset.cache.documents.values()) == 2
    assert capped.dataset.cache.directory != whole.dataset.cache.directory
    assert len(capped.dataset.cache.train) + len(capped.dataset.cache.eval) == 2 * (4096 + 1)
    again = corpus.prepare(load_config(None, sets), progress=False)
    assert again.dataset.cache.directory == whole.dataset.cache.directory and not again.dataset.cache.built
    with pytest.raises(ConfigError, match="data.max_bytes"):
        load_config(None, [*sets, "data.max_bytes=-1"])


def test_the_checkpoint_directory_holds_the_config_and_the_tokenizer(tmp_path):
    import json

    source = tmp_path / "corpus.txt"
    source.write_text("def add(a, b):\n    return a + b\n" * 300)
    config = load_config(None, [f'data.path="{source}"', 'data.tokenizer="bpe:300"', f'data.cache_dir="{tmp_path}"',
                                "data.seq_len=16", "data.global_batch=2", "model.max_seq_len=16"])
    data = corpus.prepare(config, progress=False)
    corpus.write_beside_checkpoints(data, tmp_path / "checkpoints")
    saved = json.loads((tmp_path / "checkpoints" / corpus.RUN_CONFIG).read_text())
    assert saved["model"]["vocab_size"] == data.config.model.vocab_size == 384
    copied = tmp_path / "checkpoints" / "tokenizer.json"
    assert copied.read_bytes() == open(data.tokenizer.name, "rb").read()
    assert not list((tmp_path / "checkpoints").glob("*.partial"))


def test_a_checkpoint_directory_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    data = corpus.RunData(config=load_config(), tokenizer=ByteTokenizer(), dataset=None)
    assert corpus.write_beside_checkpoints(data, blocker / "checkpoints") is False
    assert "could not be written beside the checkpoints" in capsys.readouterr().out


def test_a_trained_bpe_never_sees_the_held_out_documents(tmp_path, monkeypatch):
    from multipod.controller.data import token_cache
    source = tmp_path / "corpus"
    source.mkdir()
    for number in range(2 * token_cache.EVAL_EVERY):
        (source / f"{number:03d}.py").write_text(f"def function_{number}(x):\n    return x + {number}\n")
    seen = []

    def spy(texts, size, path):
        seen.extend(texts)
        return real(seen, size, path)

    real = corpus.train_bpe
    monkeypatch.setattr(corpus, "train_bpe", spy)
    config = load_config(None, [f'data.path="{source}"', 'data.tokenizer="bpe:300"', f'data.cache_dir="{tmp_path}"'])
    corpus.resolve_tokenizer(config, tmp_path)
    held = {n for n in range(2 * token_cache.EVAL_EVERY) if token_cache.held_out(n)}
    assert held == {49, 99}
    assert len(seen) == 2 * token_cache.EVAL_EVERY - 2
    assert not any(f"function_{n}(" in text for text in seen for n in held)
