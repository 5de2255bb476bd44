"""Tokenizers: a byte-level BPE trained here round-trips any text; tokenizer.json and SentencePiece
files load; bad tokenizer files get a TokenizerError that names them; a BPE's training sample is
spread over a large source."""
import json
import random
import re

import numpy as np
import pytest

from multipod.controller.data.tokenizer import (
    ByteTokenizer,
    TokenizerError,
    load_tokenizer,
    padded_vocab,
    sampled,
    train_bpe,
)

# Text with what a byte-level BPE must keep exactly: runs of spaces, tabs, CRLF, non-ASCII
# letters, CJK, an emoji, a literal special token and a NUL.
TRICKY = "def f(x):\n\tif x:  \r\n        return 'héllo 漢字 🙂'  # <|endoftext|> </s>\x00\n\n"


def _python_like(seed: int, functions: int = 60) -> list[str]:
    rng = random.Random(seed)
    names = ["value", "count", "items", "result", "index", "total", "name", "data"]
    docs = []
    for i in range(functions):
        a, b = rng.sample(names, 2)
        docs.append(f"def compute_{a}_{i}(self, {a}, {b}=None):\n"
                    f"    \"\"\"Return the {a} of {b}.\"\"\"\n"
                    f"    for {b} in range({rng.randint(1, 99)}):\n"
                    f"        if {a} > {b}:\n"
                    f"            {a} += self.{b}\n"
                    f"    return {a}\n")
    return docs


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _python_like(0)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory, corpus):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe(corpus, 400, path)
    return path


def test_bpe_round_trips_any_text_and_never_emits_eos(bpe_path, corpus):
    tok = load_tokenizer(str(bpe_path))
    assert tok.kind == "huggingface" and tok.name == str(bpe_path)
    assert 258 <= tok.vocab_size <= 400
    assert 0 <= tok.eos_id < tok.vocab_size
    for text in [*corpus[:5], TRICKY, "", " ", "ünïcödé only", "\x00\xff\u2028"]:
        ids = tok.encode(text)
        assert ids.ndim == 1 and ids.dtype in (np.int32, np.uint32)
        assert tok.eos_id not in ids.tolist()
        assert ids.size == 0 or (ids.min() >= 0 and ids.max() < tok.vocab_size)
        assert tok.decode(ids) == text
    # It learnt merges: the corpus takes fewer tokens than bytes.
    assert len(tok.encode(corpus[0])) < len(corpus[0].encode()) / 2
    batch = tok.encode_batch([TRICKY, corpus[1]])
    assert [b.tolist() for b in batch] == [tok.encode(TRICKY).tolist(), tok.encode(corpus[1]).tolist()]


def test_bpe_reloads_to_the_same_ids_and_fingerprint(bpe_path, tmp_path):
    one, two = load_tokenizer(str(bpe_path)), load_tokenizer(str(bpe_path))
    assert one.fingerprint == two.fingerprint and len(one.fingerprint) == 32
    assert one.encode(TRICKY).tolist() == two.encode(TRICKY).tolist()
    # The same tokenizer written differently is another file: another fingerprint.
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads(bpe_path.read_text()), indent=1))
    assert load_tokenizer(str(copy)).fingerprint != one.fingerprint
    assert load_tokenizer(str(copy)).encode(TRICKY).tolist() == one.encode(TRICKY).tolist()
    # Trained on other text: other merges, another fingerprint.
    other = train_bpe(_python_like(1), 400, tmp_path / "other.json")
    assert other.fingerprint != one.fingerprint


def test_decode_never_raises_on_odd_ids(bpe_path):
    tok = load_tokenizer(str(bpe_path))
    ids = tok.encode("abc").tolist()
    assert tok.decode([-1, *ids, tok.vocab_size, 2**40]) == "\ufffdabc\ufffd\ufffd"
    assert isinstance(tok.decode(np.arange(tok.vocab_size)), str)


def test_bpe_training_checks_its_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="--vocab-size 257"):
        train_bpe(["some text"], 257, tmp_path / "t.json")
    with pytest.raises(TokenizerError, match="--vocab-size"):
        train_bpe(["some text"], 1 << 21, tmp_path / "t.json")
    with pytest.raises(TokenizerError, match="no text to train on"):
        train_bpe(iter(["", ""]), 300, tmp_path / "t.json")
    assert not list(tmp_path.iterdir())     # nothing written


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory, corpus):
    import sentencepiece
    root = tmp_path_factory.mktemp("spm")
    (root / "corpus.txt").write_text("".join(corpus))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / "m"),
                                             vocab_size=80, minloglevel=2, num_threads=1)
    return root / "m.model"


def test_sentencepiece_model_loads_and_round_trips(sentencepiece_model, tmp_path):
    tok = load_tokenizer(str(sentencepiece_model))
    assert tok.kind == "sentencepiece" and tok.vocab_size == 80
    assert 0 <= tok.eos_id < 80
    text = "def compute_value(self, items):\n    return value"
    ids = tok.encode(text)
    assert tok.eos_id not in ids.tolist()
    # SentencePiece normalizes whitespace: newlines and indentation become single spaces.
    assert tok.decode(ids) == " ".join(text.split())
    assert [b.tolist() for b in tok.encode_batch([text, "for x"])] == [ids.tolist(), tok.encode("for x").tolist()]
    assert isinstance(tok.decode([-1, 5, 80]), str)
    # Its kind is told by the content, not the name.
    renamed = tmp_path / "sp.json"
    renamed.write_bytes(sentencepiece_model.read_bytes())
    assert load_tokenizer(str(renamed)).kind == "sentencepiece"
    assert load_tokenizer(str(renamed)).fingerprint == tok.fingerprint


def test_tokenizer_json_under_another_name_loads(bpe_path, tmp_path):
    renamed = tmp_path / "tok.model"
    renamed.write_bytes(bpe_path.read_bytes())
    assert load_tokenizer(str(renamed)).kind == "huggingface"


@pytest.mark.parametrize("name, content, problem", [
    ("missing.json", None, "does not exist"),
    ("empty.json", b"", "is empty"),
    ("blank.model", b"\n  \n", "is empty"),
    ("garbage.bin", bytes(random.Random(0).randrange(256) for _ in range(500)), "does not parse"),
    ("garbage.model", b"\xff\xfe not a model at all \x00\x01", "does not parse"),
    ("config.json", b'{"model_type": "gpt2", "n_layer": 12}', "does not parse"),
    ("broken.json", b'{"version": "1.0", "model": ', "does not parse"),
])
def test_bad_tokenizer_files_are_named(tmp_path, name, content, problem):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError, match=problem) as error:
        load_tokenizer(str(path))
    assert str(path) in str(error.value)


def test_a_directory_or_a_tokenizer_without_eos_is_named(bpe_path, tmp_path):
    with pytest.raises(TokenizerError, match="is a directory") as error:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(error.value)
    spec = json.loads(bpe_path.read_text())
    spec["added_tokens"] = []
    (tmp_path / "no-eos.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=re.escape("no end-of-text token: looked for an added token named "
                                                       "<|endoftext|>")) as error:
        load_tokenizer(str(tmp_path / "no-eos.json"))
    assert str(tmp_path / "no-eos.json") in str(error.value)


def test_padded_vocab():
    assert [padded_vocab(n) for n in (1, 128, 256, 257, 384, 4000, 4096)] == [128, 128, 256, 384, 384, 4096, 4096]


def test_byte_tokenizer_round_trips():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eos_id == 0
    text = TRICKY.replace("\x00", "")
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text


def test_a_bpe_sample_is_spread_over_a_source_larger_than_the_limit():
    """Every document while the source fits the limit; beyond it a share of each part of the source,
    in order, deterministically, up to the limit: the tokenizer of a corpus of many parts sees them
    all, not the first ones in name order."""
    docs = [f"{part}-{i:03d} " * 10 for part in ("code", "books", "web") for i in range(100)]   # 100 docs a part
    total = sum(len(d) for d in docs)
    count: dict = {}
    assert list(sampled(docs, total, count, limit=total)) == docs
    assert count == {"documents": 300, "bytes": total}
    count = {}
    sample = list(sampled(docs, total, count, limit=total // 10))
    assert sample == list(sampled(docs, total, {}, limit=total // 10))                   # deterministic
    assert [sum(d.startswith(part) for d in sample) for part in ("code", "books", "web")] == [10, 10, 10]
    assert sample == [d for d in docs if d in sample] and count["bytes"] <= total // 10
    # The old way took the first documents only: the same budget would have been code's alone.
    assert all(d.startswith("code") for d in docs[:30])
