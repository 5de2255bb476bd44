"""`multipod tokenizer train`: a byte-level BPE from a directory of text, and a clear error for a
source that does not exist."""
from multipod.controller.data.tokenizer import load_tokenizer
from tests.helpers import run_cli


def test_tokenizer_train_writes_a_tokenizer_that_round_trips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"mod{i}.py").write_text("".join(
            f"def handle_{i}_{j}(self, request):\n    return self.respond(request, status={j})\n\n"
            for j in range(50)))
    out = tmp_path / "out" / "tok.json"
    result = run_cli("tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--out", str(out),
                     timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == str(out)
    assert "4 documents" in result.stderr and str(out) in result.stderr
    tok = load_tokenizer(str(out))
    assert tok.kind == "huggingface" and 258 <= tok.vocab_size <= 300
    text = "def handle(self, request):\n\treturn 'ünïcödé'  \n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("    return self.respond(request")) < 20     # it learnt merges


def test_tokenizer_train_names_a_missing_source(tmp_path):
    missing = tmp_path / "no-such-corpus"
    out = tmp_path / "tok.json"
    result = run_cli("tokenizer", "train", "--data", str(missing), "--vocab-size", "300", "--out", str(out),
                     timeout=60)
    assert result.returncode != 0
    assert str(missing) in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_tokenizer_train_says_when_the_text_gives_fewer_tokens_than_asked(tmp_path):
    # One byte of text has no pair to merge: the vocabulary stops at the bytes and <|endoftext|>.
    (tmp_path / "one.txt").write_text("x")
    out = tmp_path / "tok.json"
    result = run_cli("tokenizer", "train", "--data", str(tmp_path / "one.txt"), "--vocab-size", "300",
                     "--out", str(out), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert load_tokenizer(str(out)).vocab_size == 257
    assert "note: 257 tokens, fewer than the 300 asked" in result.stderr


def test_tokenizer_train_names_its_own_flag_for_a_missing_text_field(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"body": "some text"}\n')
    result = run_cli("tokenizer", "train", "--data", str(tmp_path / "docs.jsonl"), "--vocab-size", "300",
                     "--out", str(tmp_path / "tok.json"), timeout=60)
    assert result.returncode != 0
    assert "no 'text' field (the record has: 'body'); set --text-field to the field" in result.stderr
