"""The token stream: byte-level tokens (vocab 256) from a corpus of text files.

The default corpus is the running Python's standard library (.py files), so a fresh machine has
real data without downloading anything. The batch for step s is a pure function of (seed, s):
random windows drawn with a generator seeded by (seed, s). That makes resuming exact, and lets
the controller build the next batches ahead of time.
"""
from __future__ import annotations

import dataclasses
import pathlib
import queue
import sysconfig
import threading

import numpy as np

from multipod.controller.errors import RunError
from multipod.protos import codec

# The last slice of the corpus is held out for evaluation.
EVAL_FRACTION = 0.02
# Cap on corpus size read into memory: files after the one that reaches it are not read.
MAX_CORPUS_BYTES = 256 << 20
# Paths listed per skip reason in the report (the counts cover them all).
REPORT_EXAMPLES = 3

# Why a file is left out of the corpus.
HIDDEN = "hidden"
UNREADABLE = "unreadable"
NOT_TEXT = "not text (contain NUL bytes)"


class DataError(ValueError):
    """The corpus cannot be used (missing, empty, too small)."""


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _over_cap() -> str:
    return f"over the {_size(MAX_CORPUS_BYTES)} cap"


@dataclasses.dataclass
class Skipped:
    """Files the loader left out for one reason."""
    files: int = 0
    bytes: int = 0      # their size on disk (0 for a file whose size cannot be read)
    examples: list[str] = dataclasses.field(default_factory=list)   # the first REPORT_EXAMPLES


@dataclasses.dataclass
class CorpusReport:
    """What load_corpus read, and what it left out and why (reason -> Skipped)."""
    source: str
    files_read: int = 0
    bytes_read: int = 0
    skipped: dict[str, Skipped] = dataclasses.field(default_factory=dict)

    def skip(self, why: str, file: pathlib.Path, size: int | None = None, detail: str = "") -> None:
        """Count `file` as left out because of `why` (its size: from the disk if not given)."""
        if size is None:
            try:
                size = file.stat().st_size
            except OSError:
                size = 0
        entry = self.skipped.setdefault(why, Skipped())
        entry.files += 1
        entry.bytes += size
        if len(entry.examples) < REPORT_EXAMPLES:
            root = pathlib.Path(self.source)    # names under the corpus directory, relative to it
            name = str(file.relative_to(root)) if file != root and file.is_relative_to(root) else str(file)
            entry.examples.append(f"{name} ({detail})" if detail else name)

    def summary(self) -> str:
        """One line for the user, e.g. `corpus DIR: read 3 file(s) (1.2 MiB); skipped 2 file(s)
        (4.0 KiB): 1 unreadable: a.txt (Permission denied); 1 hidden: .b`."""
        line = f"corpus {self.source}: read {self.files_read:,} file(s) ({_size(self.bytes_read)})"
        if not self.skipped:
            return line + "; nothing skipped"
        files = sum(s.files for s in self.skipped.values())
        size = sum(s.bytes for s in self.skipped.values())
        reasons = "; ".join(f"{s.files:,} {why}: {', '.join(s.examples)}{', ...' if s.files > len(s.examples) else ''}"
                            for why, s in self.skipped.items())
        return f"{line}; skipped {files:,} file(s) ({_size(size)}): {reasons}"


def default_corpus_root() -> pathlib.Path:
    """The running Python's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_hidden(file: pathlib.Path, root: pathlib.Path) -> bool:
    """A dotfile, or a file inside a dot-directory (.git, .venv, ...) under root."""
    return any(part.startswith(".") for part in file.relative_to(root).parts)


def _candidates(path: str) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(the corpus files in a fixed, sorted order; the hidden files of a directory left out)."""
    if not path:
        root = default_corpus_root()
        return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts), []
    target = pathlib.Path(path)
    if target.is_file():
        return [target], []
    if target.is_dir():
        files = sorted(p for p in target.rglob("*") if p.is_file())
        hidden = [p for p in files if _is_hidden(p, target)]
        return [p for p in files if not _is_hidden(p, target)], hidden
    raise DataError(f"data path {path!r} is neither a file nor a directory")


def corpus_files(path: str = "") -> list[pathlib.Path]:
    """The files that make up the corpus, in a fixed (sorted) order."""
    return _candidates(path)[0]


def read_corpus(path: str = "") -> tuple[np.ndarray, CorpusReport]:
    """All text of the corpus as uint8 tokens (documents separated by a NUL byte), and a report
    of what was read and what was left out: hidden files of a directory, unreadable files, files
    that are not text (a NUL byte: binary, and it would also blur the document boundaries), and
    the files after the one that reached MAX_CORPUS_BYTES. DataError if no text is left."""
    files, hidden = _candidates(path)
    report = CorpusReport(source=path or str(default_corpus_root()))
    for file in hidden:
        report.skip(HIDDEN, file)
    parts, total = [], 0
    for index, file in enumerate(files):
        if total >= MAX_CORPUS_BYTES:
            for rest in files[index:]:
                report.skip(_over_cap(), rest)
            break
        try:
            data = file.read_bytes()
        except OSError as exc:
            report.skip(UNREADABLE, file, detail=exc.strerror or type(exc).__name__)
            continue
        if b"\0" in data:
            report.skip(NOT_TEXT, file, size=len(data))
            continue
        parts.append(data)
        parts.append(b"\0")
        report.files_read += 1
        report.bytes_read += len(data)
        total += len(data) + 1
    tokens = np.frombuffer(b"".join(parts), dtype=np.uint8)
    if tokens.size == 0:
        raise DataError(f"corpus {report.source} has no text to train on: {report.summary()}")
    return tokens, report


def load_corpus(path: str = "") -> np.ndarray:
    """read_corpus's tokens; its report goes to the user as one status line (metrics.out)."""
    from multipod.controller.metrics import out
    tokens, report = read_corpus(path)
    out(report.summary())
    return tokens


class Batches:
    """Global batches of int32 tokens [global_batch, seq_len + 1] for a step, from (seed, step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        split = int(tokens.size * (1 - EVAL_FRACTION))
        self.train, self.eval = tokens[:split], tokens[split:]
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        for name, part in (("training", self.train), ("evaluation", self.eval)):
            if part.size < seq_len + 2:
                raise DataError(f"the {name} part of the corpus has {part.size} bytes; "
                                f"need more than seq_len + 1 = {seq_len + 1}")

    def _windows(self, source: np.ndarray, rng: np.random.Generator, rows: int) -> np.ndarray:
        starts = rng.integers(0, source.size - self.seq_len - 1, size=rows)
        index = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return source[index].astype(np.int32)

    def batch(self, step: int) -> np.ndarray:
        """The training batch for `step`: depends only on (seed, step)."""
        return self._windows(self.train, np.random.default_rng([self.seed, step]), self.global_batch)

    def eval_batch(self, index: int) -> np.ndarray:
        """Held-out batch `index`, from a stream independent of the training one."""
        return self._windows(self.eval, np.random.default_rng([self.seed, 1 << 40, index]), self.global_batch)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest integer dtype that holds every id of the vocabulary and that the wire codec
    carries: uint8 up to 256 ids, uint16 up to 65536, int32 beyond. Batches travel in it and the
    worker widens them on its devices."""
    for dtype, limit in ((np.uint8, 1 << 8), (np.uint16, 1 << 16)):
        if vocab_size <= limit and np.dtype(dtype).name in codec.DTYPES:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def narrow(tokens: np.ndarray, dtype=None) -> np.ndarray:
    """`tokens` as `dtype` (default: the narrowest that holds their values) for the wire."""
    if dtype is None:
        dtype = token_dtype(int(tokens.max()) + 1 if tokens.size else 1)
    dtype = np.dtype(dtype)
    if tokens.size and dtype != tokens.dtype and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DataError(f"token ids in [{tokens.min()}, {tokens.max()}] do not fit {dtype}")
    return tokens.astype(dtype, copy=False)


def shard(batch: np.ndarray, num_pods: int) -> list[np.ndarray]:
    """Cut a global batch into one contiguous shard per pod."""
    if batch.shape[0] % num_pods:
        raise DataError(f"global batch of {batch.shape[0]} does not split over {num_pods} pods")
    return np.split(batch, num_pods)


class Prefetcher:
    """Builds the encoded per-pod shards of steps start..stop-1 on a background thread, `depth`
    steps ahead, so the step loop never waits for data. Step s trains on batch s + offset (the
    offset grows when a loss-spike rewind skips batches). `batches` is anything with batch(i).
    Shards are encoded as `dtype` (data.token_dtype of the vocabulary: uint8 for bytes)."""

    def __init__(self, batches, num_pods: int, start: int, stop: int, depth: int = 4, offset: int = 0,
                 dtype=np.int32):
        self._dtype = np.dtype(dtype)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, num_pods, start, stop, offset),
                                        daemon=True, name="prefetch")
        self._thread.start()

    def _run(self, batches, num_pods: int, start: int, stop: int, offset: int) -> None:
        for step in range(start, stop):
            try:
                item = (step, [codec.encode(narrow(s, self._dtype))
                               for s in shard(batches.batch(step + offset), num_pods)])
            except Exception as exc:   # handed to the loop, which raises it: not a silent stall
                item = (step, exc)
            # Short waits on a full queue, so that close() is noticed soon.
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item[1], Exception):
                return

    def next(self, timeout_s: float = 60.0) -> tuple[int, list[bytes]]:
        """(step, encoded shards) of the next step; RunError if none comes within timeout_s."""
        try:
            step, shards = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise RunError(f"the data pipeline produced no batch within {timeout_s:g}s") from None
        if isinstance(shards, Exception):
            raise shards
        return step, shards

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, join_s: float = 1.0) -> None:
        """Stop the producer thread (waiting up to join_s for it to end)."""
        self._stop.set()
        self._thread.join(timeout=join_s)


def encode_text(text: str) -> np.ndarray:
    """UTF-8 bytes of text as int32 tokens."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode_tokens(tokens) -> str:
    """Byte tokens back to text (invalid UTF-8 replaced)."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")
