"""Tokenizers: text <-> token ids, on the controller only (workers see ids).

`data.tokenizer` names one:
- "bytes": the UTF-8 bytes of the text (256 ids; EOS is the NUL byte, which text files lack);
- a path to a Hugging Face `tokenizer.json` (the `tokenizers` library);
- a path to a SentencePiece model (`*.model`).
The file's kind is told by its content (a tokenizer.json is JSON), not by its name.
Every tokenizer has a fingerprint (a hash of what defines it) that keys the token cache, and an
EOS id that ends every document.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from multipod.controller.core.run_config import MAX_BPE_VOCAB, MIN_BPE_VOCAB
from multipod.controller.data.batches import DataError

# The model's vocabulary is padded up to a multiple of this, so that it shards over any model
# axis that divides it (and the embedding matmul stays aligned).
VOCAB_MULTIPLE = 128
BPE_EOS = "<|endoftext|>"
# A BPE is trained on at most this much text (documents spread over a larger source: `sampled`),
# so that it takes seconds (the whole default corpus, ~30 MiB of stdlib .py, trains in ~5 s on 2 cores).
TRAIN_BYTES = 32 << 20
# Names of the end-of-text token in common tokenizer.json files, in order of preference (GPT-2 and
# most BPEs, Llama 3, T5 / Mistral / Llama 2, Gemma, BERT).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded or used; the message names the file."""


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """vocab_size rounded up to a multiple of `multiple`."""
    return -(-vocab_size // multiple) * multiple


class Tokenizer:
    """The interface every tokenizer offers.

    name: "bytes" or the file it was loaded from; kind: "bytes" | "huggingface" | "sentencepiece";
    vocab_size: the number of ids it can emit (its largest id + 1); eos_id: the id that ends a
    document; fingerprint: a hex digest of what defines it (the file's bytes)."""

    name: str
    kind: str
    vocab_size: int
    eos_id: int
    fingerprint: str

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` (no EOS added), as a 1-D integer array."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """encode() of each text; tokenizers with a parallel batch path override it."""
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        """The text of `ids` (ids it cannot decode are replaced, never an error)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the user, e.g. `BPE tokenizer.json (huggingface, 4,000 tokens)`."""
        return f"{self.name} ({self.kind}, {self.vocab_size:,} tokens)"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; EOS is 0 (NUL). Text files with a NUL byte are left out of a
    corpus, but a NUL inside a .jsonl or .parquet string would read as a document's end."""

    name = kind = "bytes"
    vocab_size = 256
    eos_id = 0
    fingerprint = hashlib.blake2b(b"multipod bytes tokenizer v1", digest_size=16).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(t) & 0xFF for t in ids).decode("utf-8", errors="replace")


def _hash(kind: str, data: bytes) -> str:
    return hashlib.blake2b(kind.encode() + b"\0" + data, digest_size=16).hexdigest()


def _decode_valid(ids, vocab_size: int, decode: Callable[[list[int]], str]) -> str:
    """decode() of `ids`, with each id outside [0, vocab_size) shown as U+FFFD: the libraries
    raise on negative ids (and SentencePiece on any id out of range)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    edges = [-1, *np.flatnonzero((ids < 0) | (ids >= vocab_size)).tolist(), len(ids)]
    return "\ufffd".join(decode(ids[a + 1:b].tolist()) for a, b in zip(edges, edges[1:]))


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json. EOS is its end-of-text special token; special
    tokens written in the text are encoded as plain text, so that only the pipeline ends documents."""

    kind = "huggingface"

    def __init__(self, name: str, tok, fingerprint: str):
        self.name, self._tok, self.fingerprint = name, tok, fingerprint
        tok.encode_special_tokens = True
        added = tok.get_added_tokens_decoder()      # id -> AddedToken
        # The largest id + 1: ids may have holes, and the model must have a row for every id.
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True),
                              max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1,
                              max(added, default=-1) + 1)
        # A special token first: a non-special added token is emitted wherever its text occurs.
        found = sorted((not token.special, EOS_NAMES.index(token.content), i)
                       for i, token in added.items() if token.content in EOS_NAMES)
        if not found:
            raise TokenizerError(f"tokenizer {name} has no end-of-text token: looked for an added token "
                                 f"named {', '.join(EOS_NAMES)}")
        self.eos_id = found[0][2]

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # The library's parallel path (Rayon threads); the _fast variant skips the offsets.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.array(e.ids, dtype=np.int32) for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return _decode_valid(ids, self.vocab_size, lambda v: self._tok.decode(v, skip_special_tokens=False))


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; EOS is its eos piece. Its normalizer may change the text (NFKC,
    runs of spaces), so decode(encode(text)) is not always the text."""

    kind = "sentencepiece"

    def __init__(self, name: str, sp, fingerprint: str):
        self.name, self._sp, self.fingerprint = name, sp, fingerprint
        self.vocab_size = sp.get_piece_size()
        self.eos_id = sp.eos_id()
        if self.eos_id < 0:
            raise TokenizerError(f"tokenizer {name}: the SentencePiece model has no EOS piece "
                                 f"(it was trained with eos_id=-1)")

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._sp.encode(text, out_type=int), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array(ids, dtype=np.int32) for ids in self._sp.encode(list(texts), out_type=int)]

    def decode(self, ids) -> str:
        return _decode_valid(ids, self.vocab_size, self._sp.decode)


def _parse_huggingface(data: bytes):
    from tokenizers import Tokenizer as HFTokenizer
    return HFTokenizer.from_buffer(data)


def _parse_sentencepiece(data: bytes):
    import sentencepiece
    try:
        sp = sentencepiece.SentencePieceProcessor(model_proto=data)
    except RuntimeError as exc:     # its message is a C++ source location
        raise ValueError("not a SentencePiece model protobuf" if "ParseFromArray" in str(exc) else str(exc)) from exc
    if sp.get_piece_size() == 0:     # protobuf accepts some garbage as an empty model
        raise ValueError("a SentencePiece model with no pieces")
    return sp


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names: "bytes", a tokenizer.json or a SentencePiece model.
    TokenizerError naming the file if it is missing or does not parse."""
    if spec == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    try:
        data = path.read_bytes()    # once: what is parsed is what is fingerprinted
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer {spec} does not exist") from None
    except IsADirectoryError:
        raise TokenizerError(f"tokenizer {spec} is a directory, not a tokenizer.json or SentencePiece model") from None
    except OSError as exc:
        raise TokenizerError(f"tokenizer {spec} cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise TokenizerError(f"tokenizer {spec} is empty")
    kinds = [("huggingface", _parse_huggingface, HuggingFaceTokenizer),
             ("sentencepiece", _parse_sentencepiece, SentencePieceTokenizer)]
    if not (path.suffix == ".json" or data.lstrip()[:1] == b"{"):
        kinds.reverse()             # a SentencePiece model is a binary protobuf
    errors = []
    for kind, parse, cls in kinds:
        try:
            parsed = parse(data)
        except Exception as exc:    # noqa: BLE001 -- both libraries raise bare Exception subclasses
            errors.append(str(exc).strip() or type(exc).__name__)
            continue
        return cls(str(path), parsed, _hash(kind, data))   # the path read: copyable beside checkpoints
    # The first guess's complaint is the one that describes the file.
    raise TokenizerError(f"tokenizer {spec} does not parse as a Hugging Face tokenizer.json or a "
                         f"SentencePiece model: {errors[0]}")


def train_bpe(texts: Iterable[str], vocab_size: int, out: pathlib.Path | str, *,
              source: str = "the texts given") -> HuggingFaceTokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (with <|endoftext|>) on `texts`,
    write it to `out` (a tokenizer.json, replaced atomically) and return it loaded.
    Byte-level: every text round-trips exactly, whatever its characters."""
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE needs {MIN_BPE_VOCAB} to "
                             f"{MAX_BPE_VOCAB:,} tokens (the 256 bytes, {BPE_EOS} and at least one merge)")
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    texts = iter(texts)
    first = next((t for t in texts if t), None)
    if first is None:
        raise TokenizerError(f"{source}: no text to train on")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The full byte alphabet even if the corpus lacks some bytes, so that any text encodes.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(itertools.chain([first], texts), trainer)
    out, tmp = pathlib.Path(out), None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # A temp file in the same directory, then a rename: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tok.to_str())
        os.replace(tmp, out)
    except OSError as exc:
        raise TokenizerError(f"cannot write the tokenizer to {out}: {exc.strerror or exc}") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    return load_tokenizer(str(out))


def sampled(texts: Iterable[str], source_bytes: int, count: dict, limit: int = TRAIN_BYTES) -> Iterator[str]:
    """At most `limit` UTF-8 bytes of `texts` (so that BPE training takes seconds), spread evenly
    over a source of about `source_bytes`: every document while the source fits, else a share of
    limit / source_bytes of the documents' bytes, taken where their running total crosses each
    step of it (error diffusion: deterministic, and as even as whole documents allow). A corpus
    of many parts (code/, books/, web/) then trains its tokenizer on all of them, not on the
    first 32 MiB in name order. count["documents"] and count["bytes"] say how much was given."""
    count.setdefault("documents", 0)
    count.setdefault("bytes", 0)
    share = 1.0 if source_bytes <= limit else limit / source_bytes
    credit = 0.0
    for text in texts:
        if count["bytes"] >= limit:
            return
        size = len(text.encode("utf-8"))
        credit += share * size
        if credit < size * (1.0 - 1e-9):
            continue
        credit -= size
        count["documents"] += 1
        count["bytes"] += size
        yield text


def train_main(args) -> int:
    """`multipod tokenizer train`: train a byte-level BPE and write tokenizer.json; exit code."""
    from multipod.controller.data.sources import iter_documents, source_bytes
    source = args.data or "Python's standard library"
    count: dict = {}
    start = time.perf_counter()
    size = source_bytes(args.data)
    texts = sampled((doc.text for doc in iter_documents(args.data, text_field=args.text_field,
                                                                 text_field_name="--text-field")), size, count)
    tok = train_bpe(texts, args.vocab_size, args.out, source=source)
    cut = f" (spread over its {size / (1 << 20):,.0f} MiB)" if size > TRAIN_BYTES else ""
    print(f"trained a byte-level BPE of {tok.vocab_size:,} tokens on {count['documents']:,} documents, "
          f"{count['bytes'] / (1 << 20):.1f} MiB of {source}{cut}, in {time.perf_counter() - start:.1f} s: "
          f"{args.out}", file=sys.stderr)
    if tok.vocab_size < args.vocab_size:
        # BPE stops when no pair of tokens is left to merge: too little (or too uniform) text.
        print(f"note: {tok.vocab_size:,} tokens, fewer than the {args.vocab_size:,} asked: the text has no more "
              f"pairs to merge; train on more text for a larger vocabulary", file=sys.stderr)
    print(args.out)
    return 0
