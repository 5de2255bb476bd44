"""The token cache: a source is tokenized once, then memory-mapped on every later run.

open_cache(path, tokenizer, cache_root) finds the cache in `cache_root/tokens/<key>`, where the key
is a digest of the format version, sources.source_fingerprint (the files' names, sizes and mtimes,
and the size cap data.max_bytes), the tokenizer's fingerprint, the text field and the split rule:
while none of them changes, the cache is reused and nothing is read from the source. Otherwise it
is built, from a source of any size (shard by shard, a batch of documents in memory at a time):
- documents are encoded a batch at a time (tokenizer.encode_batch: the HF tokenizer runs a batch in
  parallel), each followed by tokenizer.eos_id, and appended to its split's stream;
- a stream is written as shards `train-00000.bin`, `train-00001.bin`, ... (and `eval-*.bin`) of at
  most SHARD_TOKENS tokens, uint16 if the vocabulary fits in 65536 ids, else uint32;
- `index.json` comes last: format, dtype, source, tokenizer, per split the shards and their token
  counts, documents and UTF-8 bytes of text (for bits per byte), and the corpus report.
The build goes to a temporary directory beside the final one and is renamed into place at the end,
so a crash never leaves a half cache that looks complete; if another process published the same
key meanwhile, its cache is used.

The held-out split: document i goes to eval when i % EVAL_EVERY == EVAL_EVERY - 1 (2% of the
documents, spread over the whole corpus, so eval is not one corner of it). A source of fewer than
EVAL_EVERY documents (one file, say) has no such document: then the last 1/EVAL_EVERY of the token
stream (at least one token) moves to eval, and its bytes of text are counted pro rata within the
document it cuts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

from multipod.controller.data import sources
from multipod.controller.data.batches import DataError
from multipod.controller.data.cache_store import mark_used

# Bump when the layout or the meaning of the files changes: old caches are then never reused.
FORMAT_VERSION = 1
# Tokens per shard file at most (32 MiB of uint16).
SHARD_TOKENS = 1 << 24
# Every EVAL_EVERY-th document is held out.
EVAL_EVERY = 50


def held_out(number: int) -> bool:
    """Whether document `number` (0-based, in source order) belongs to the held-out split (a
    trained tokenizer leaves these out too, so evaluation sees text it never saw)."""
    return number % EVAL_EVERY == EVAL_EVERY - 1

SPLIT_RULE = (f"doc i -> eval if i % {EVAL_EVERY} == {EVAL_EVERY - 1}; "
              f"under {EVAL_EVERY} docs: last 1/{EVAL_EVERY} of tokens")
# Documents (and characters) per encode_batch call: big enough for the HF tokenizer's threads,
# small enough to bound memory whatever the documents' sizes.
ENCODE_BATCH = 512
ENCODE_BATCH_CHARS = 16 << 20
SPLITS = ("train", "eval")


class TokenStream:
    """One split's tokens, concatenated over its shard files (memory-mapped when first read)."""

    def __init__(self, directory: pathlib.Path, shards: list[tuple[str, int]], dtype: np.dtype):
        self._files = [directory / name for name, _ in shards]
        self._counts = [count for _, count in shards]
        self._starts = np.concatenate([[0], np.cumsum(self._counts, dtype=np.int64)])
        self._maps: list[np.memmap | None] = [None] * len(shards)
        self.dtype = dtype

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, index: int) -> np.memmap:
        if self._maps[index] is None:
            self._maps[index] = np.memmap(self._files[index], dtype=self.dtype, mode="r", shape=(self._counts[index],))
        return self._maps[index]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as a new array, across shard boundaries if need be."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) of a stream of {len(self)}")
        pieces, end = [], start + length
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < end:
            offset = start - int(self._starts[shard])
            take = min(end - start, self._counts[shard] - offset)
            pieces.append(self._shard(shard)[offset:offset + take])
            start += take
            shard += 1
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)


@dataclasses.dataclass
class TokenCache:
    """An opened token cache. built: whether this open built it (False: reused). documents and
    text_bytes: per split ("train", "eval")."""
    directory: pathlib.Path
    dtype: np.dtype
    built: bool
    train: TokenStream
    eval: TokenStream
    documents: dict[str, int]
    text_bytes: dict[str, int]
    report_summary: str
    index: dict

    def describe(self) -> str:
        """e.g. `9.1M train tokens, 180k eval tokens, 4,012 documents`."""
        return (f"{_count(len(self.train))} train tokens, {_count(len(self.eval))} eval tokens, "
                f"{sum(self.documents.values()):,} documents")


def _count(n: int) -> str:
    """1,234 / 180k / 9.1M / 1.2G: exact while short, rounded when big."""
    if n < 10_000:
        return f"{n:,}"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


def cache_key(path: str, tokenizer, text_field: str = "text", max_bytes: int = 0) -> str:
    """The cache directory's name for this source, tokenizer, text field and size cap (stats files
    only)."""
    blob = json.dumps([FORMAT_VERSION, sources.source_fingerprint(path, text_field, max_bytes), tokenizer.fingerprint,
                       text_field, SPLIT_RULE])
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def open_cache(path: str, tokenizer, cache_root: pathlib.Path, text_field: str = "text", progress: bool = True,
               shard_tokens: int | None = None, max_bytes: int = 0) -> TokenCache:
    """The token cache of the source at `path` ("" = the default corpus) under this tokenizer:
    reused if complete, else built (with a progress bar on a terminal unless progress=False), from
    the whole source or, with max_bytes > 0, its files up to that size (sources.iter_documents).
    Prints the corpus report and one status line. DataError if the source has no text."""
    from multipod.controller.observe.metrics import out
    final = pathlib.Path(cache_root) / "tokens" / cache_key(path, tokenizer, text_field, max_bytes)
    cache = _load(final, built=False)
    if cache is None:
        start = time.monotonic()
        _build(path, tokenizer, text_field, final, progress, shard_tokens or SHARD_TOKENS, max_bytes)
        cache = _load(final, built=True)
        if cache is None:
            raise DataError(f"token cache {final} was built but does not load")
        out(cache.report_summary)
        out(f"token cache: built {final} ({cache.describe()}, {time.monotonic() - start:.1f} s)")
    else:
        out(cache.report_summary)
        out(f"token cache: reusing {final} ({cache.describe()})")
    mark_used(final)        # what `multipod cache prune` goes by
    return cache


def _load(directory: pathlib.Path, built: bool) -> TokenCache | None:
    """The cache in `directory` if it is complete and intact, else None (a broken one is removed)."""
    try:
        index = json.loads((directory / "index.json").read_text())
        if index.get("format") != FORMAT_VERSION:
            raise ValueError("another format")
        dtype = np.dtype(index["dtype"])
        streams = {}
        for split in SPLITS:
            shards = [(name, int(count)) for name, count in index["splits"][split]["shards"]]
            for name, count in shards:     # a truncated or lost shard: the cache is not intact
                if (directory / name).stat().st_size != count * dtype.itemsize:
                    raise ValueError(f"{name} has the wrong size")
            streams[split] = TokenStream(directory, shards, dtype)
    except (OSError, ValueError, KeyError, TypeError):
        # Not there (the usual miss), or broken: no index, a lost or truncated shard. A broken one
        # goes, so that the build can rename a whole one into its place.
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
        return None
    splits = index["splits"]
    return TokenCache(directory=directory, dtype=dtype, built=built, train=streams["train"], eval=streams["eval"],
                      documents={s: splits[s]["documents"] for s in SPLITS},
                      text_bytes={s: splits[s]["text_bytes"] for s in SPLITS},
                      report_summary=index["report"], index=index)


class _StreamWriter:
    """Appends a split's tokens to shard files of at most shard_tokens tokens each."""

    def __init__(self, directory: pathlib.Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[list] = []      # [name, tokens]
        self._file = None

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.shards)

    def append(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None or self.shards[-1][1] == self.shard_tokens:
                self.close()
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._file = open(self.directory / name, "wb")
                self.shards.append([name, 0])
            take = min(tokens.size, self.shard_tokens - self.shards[-1][1])
            self._file.write(tokens[:take].tobytes())
            self.shards[-1][1] += take
            tokens = tokens[take:]

    def take_tail(self, count: int) -> np.ndarray:
        """Remove the last `count` tokens from the stream and return them."""
        self.close()
        pieces = []
        while count:
            name, have = self.shards[-1]
            take = min(count, have)
            file = self.directory / name
            pieces.append(np.fromfile(file, self.dtype, offset=(have - take) * self.dtype.itemsize))
            if take == have:
                file.unlink()
                self.shards.pop()
            else:
                os.truncate(file, (have - take) * self.dtype.itemsize)
                self.shards[-1][1] -= take
            count -= take
        return np.concatenate(pieces[::-1]) if pieces else np.empty(0, self.dtype)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _progress_bar(path: str, enabled: bool, max_bytes: int):
    """A transient rich progress bar on stderr over the source's bytes on disk (None if off)."""
    if not (enabled and sys.stderr.isatty()):
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    total = sources.source_bytes(path, max_bytes)
    bar = Progress(TextColumn("tokenizing {task.description}"), BarColumn(), DownloadColumn(),
                   TextColumn("{task.fields[documents]:,} documents"), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    # The source's last component: a full path would crowd the bar out of a narrow terminal.
    task = bar.add_task(pathlib.Path(sources.source_name(path)).name, total=total, documents=0)
    bar.start()
    return bar, task


# A build folder untouched for this long was left by a process that died mid-build.
ABANDONED_S = 3600.0


def _remove_abandoned(final: pathlib.Path) -> None:
    """Delete the build folders of `final` that a killed process left behind (a build still
    running elsewhere writes to its folder, so it is younger than ABANDONED_S)."""
    for folder in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            newest = max([folder.stat().st_mtime] + [f.stat().st_mtime for f in folder.iterdir()])
        except OSError:
            continue
        if time.time() - newest > ABANDONED_S:
            shutil.rmtree(folder, ignore_errors=True)


def _build(path: str, tokenizer, text_field: str, final: pathlib.Path, progress: bool, shard_tokens: int,
           max_bytes: int) -> None:
    """Tokenize the source into a temporary directory, then rename it to `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    writers = {split: _StreamWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    text_bytes = dict.fromkeys(SPLITS, 0)
    first_docs: list[tuple[int, int]] = []    # (tokens with EOS, bytes) of the first EVAL_EVERY documents
    report = sources.CorpusReport()
    bar, task = _progress_bar(path, progress, max_bytes)
    start = time.monotonic()

    def encode(texts: list[str]) -> None:
        parts = {split: [] for split in SPLITS}
        for text, ids in zip(texts, tokenizer.encode_batch(texts)):
            ids = np.asarray(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise DataError(f"tokenizer {tokenizer.name} gave id {int(ids.max())} outside its vocabulary "
                                f"of {tokenizer.vocab_size} (source {report.source})")
            number = sum(documents.values())
            split = "eval" if held_out(number) else "train"
            size = len(text.encode("utf-8"))
            parts[split] += [ids, [tokenizer.eos_id]]
            documents[split] += 1
            text_bytes[split] += size
            if len(first_docs) < EVAL_EVERY:
                first_docs.append((ids.size + 1, size))
        for split, arrays in parts.items():
            if arrays:
                writers[split].append(np.concatenate(arrays))
        if bar is not None:
            bar.update(task, completed=report.bytes_read + report.bytes_skipped, documents=sum(documents.values()))

    try:
        pending, chars = [], 0
        for doc in sources.iter_documents(path, text_field, report, max_bytes=max_bytes):
            pending.append(doc.text)
            chars += len(doc.text)
            if len(pending) >= ENCODE_BATCH or chars >= ENCODE_BATCH_CHARS:
                encode(pending)
                pending, chars = [], 0
        encode(pending)
        if sum(text_bytes.values()) == 0:
            raise DataError(f"corpus {report.source} has no text to tokenize: {report.summary()}")
        if documents["eval"] == 0:
            _tail_to_eval(writers, first_docs, text_bytes)
        for writer in writers.values():
            writer.close()
        index = {
            "format": FORMAT_VERSION, "dtype": dtype.name, "source": report.source, "text_field": text_field,
            "max_bytes": max_bytes,
            "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
                          "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
            "split_rule": SPLIT_RULE, "report": report.summary(), "build_seconds": round(time.monotonic() - start, 3),
            "splits": {split: {"shards": writers[split].shards, "tokens": writers[split].tokens,
                               "documents": documents[split], "text_bytes": text_bytes[split]} for split in SPLITS},
        }
        # Written last: its presence is what makes a cache complete.
        (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "index.json").exists():   # not another process's finished cache
                raise
            shutil.rmtree(tmp, ignore_errors=True)    # another process published it first: use theirs
    except BaseException:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.stop()


def _tail_to_eval(writers: dict, first_docs: list[tuple[int, int]], text_bytes: dict[str, int]) -> None:
    """Under EVAL_EVERY documents: move the last 1/EVAL_EVERY of the train tokens (at least one)
    to eval, with the bytes of text they stand for (whole documents exactly, the cut one pro rata)."""
    total = writers["train"].tokens
    count = max(1, total // EVAL_EVERY) if total > 1 else 0
    writers["eval"].append(writers["train"].take_tail(count))
    moved, left = 0.0, count
    for tokens, size in reversed(first_docs):
        share = min(left, tokens)
        # Walking back from the end, a touched document always gives its EOS (no text) and
        # share - 1 of its text tokens; its bytes are spread evenly over those.
        moved += size * (share - 1) / max(tokens - 1, 1)
        left -= share
        if not left:
            break
    moved_bytes = min(round(moved), text_bytes["train"])
    text_bytes["eval"] += moved_bytes
    text_bytes["train"] -= moved_bytes
