"""Tokenizers: text <-> token ids, on the controller only (workers see ids).

`data.tokenizer` names one:
- "bytes": the UTF-8 bytes of the text (256 ids; EOS is the NUL byte, which text files lack);
- a path to a Hugging Face `tokenizer.json` (the `tokenizers` library);
- a path to a SentencePiece model (`*.model`).
Every tokenizer has a fingerprint (a hash of what defines it) that keys the token cache, and an
EOS id that ends every document.
"""
from __future__ import annotations

import hashlib

import numpy as np

from multipod.controller.data import DataError

# The model's vocabulary is padded up to a multiple of this, so that it shards over any model
# axis that divides it (and the embedding matmul stays aligned).
VOCAB_MULTIPLE = 128


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
    """UTF-8 bytes as ids 0..255; EOS is 0 (NUL), which the corpus loader keeps out of text."""

    name = kind = "bytes"
    vocab_size = 256
    eos_id = 0
    fingerprint = hashlib.blake2b(b"multipod bytes tokenizer v1", digest_size=16).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(t) & 0xFF for t in ids).decode("utf-8", errors="replace")


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names: "bytes", a tokenizer.json or a SentencePiece model.
    TokenizerError naming the file if it is missing or does not parse."""
    if spec == "bytes":
        return ByteTokenizer()
    raise TokenizerError(f"data.tokenizer {spec!r}: not supported yet")


def train_main(args) -> int:
    """`multipod tokenizer train`: train a byte-level BPE and write tokenizer.json; exit code."""
    raise NotImplementedError
