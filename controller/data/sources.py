"""Documents from a data source: text files, directories, .jsonl and .parquet, one at a time.

This module only finds and reads documents; tokenizing them is token_cache.py's job. A source is:
- "" : the default corpus, the running Python's standard library (.py files, no site-packages, no
  `encodings` package, whose code-page tables are data rather than code), so a fresh machine has
  real data without downloading anything;
- a file: one source, read by its suffix (below);
- a directory: every non-hidden file under it, in sorted order, each read by its suffix.
By suffix: `.jsonl` gives one document per non-empty line (the string in `text_field`),
`.parquet` one per row of the `text_field` column (read in record batches, never all at once),
anything else is a text file and one document (UTF-8, invalid bytes replaced; a file with a NUL
byte is binary and left out as "not text").

What is left out is counted in a CorpusReport: hidden files of a directory, unreadable files, files
that are not text, and, under a size cap (data.max_bytes), the files after the one that reached it.
A malformed .jsonl or .parquet is a DataError naming the file (and line) even inside a directory:
dropping part of a dataset without a word would change what the model trains on. A file named on
its own that cannot be used at all is an error too. Without a cap a source is read whole, whatever
its size: documents are yielded one at a time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterator

from multipod.controller.data.batches import DataError

# Paths listed per skip reason in the report (the counts cover them all).
REPORT_EXAMPLES = 3
# Rows per record batch read from a parquet file: bounded memory whatever the file's size.
PARQUET_BATCH_ROWS = 1024

# Why a file is left out of the corpus.
HIDDEN = "hidden"
UNREADABLE = "unreadable"
NOT_TEXT = "not text (contain NUL bytes)"


@dataclasses.dataclass(frozen=True)
class Document:
    """One document's text, and where it came from: the file, plus `:LINE` (1-based) for a jsonl
    line or `:ROW` (0-based, as pyarrow and pandas count) for a parquet row."""
    source: str
    text: str


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _over_cap(max_bytes: int) -> str:
    return f"over the data.max_bytes cap of {_size(max_bytes)}"


@dataclasses.dataclass
class Skipped:
    """Files the loader left out for one reason."""
    files: int = 0
    bytes: int = 0      # their size on disk (0 for a file whose size cannot be read)
    examples: list[str] = dataclasses.field(default_factory=list)   # the first REPORT_EXAMPLES


@dataclasses.dataclass
class CorpusReport:
    """What iter_documents read (files, and their size on disk, counted as they are read), and what
    it left out and why (reason -> Skipped). source "" is filled in by iter_documents."""
    source: str = ""
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

    @property
    def bytes_skipped(self) -> int:
        return sum(s.bytes for s in self.skipped.values())

    def summary(self) -> str:
        """One line for the user, e.g. `corpus DIR: read 3 file(s) (1.2 MiB); skipped 2 file(s)
        (4.0 KiB): 1 unreadable: a.txt (Permission denied); 1 hidden: .b`."""
        line = f"corpus {self.source}: read {self.files_read:,} file(s) ({_size(self.bytes_read)})"
        if not self.skipped:
            return line + "; nothing skipped"
        files = sum(s.files for s in self.skipped.values())
        reasons = "; ".join(f"{s.files:,} {why}: {', '.join(s.examples)}{', ...' if s.files > len(s.examples) else ''}"
                            for why, s in self.skipped.items())
        return f"{line}; skipped {files:,} file(s) ({_size(self.bytes_skipped)}): {reasons}"


def default_corpus_root() -> pathlib.Path:
    """The running Python's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_name(path: str) -> str:
    """The source as the user sees it: the path, or the stdlib directory for the default ""."""
    return path or str(default_corpus_root())


def _is_hidden(file: pathlib.Path, root: pathlib.Path) -> bool:
    """A dotfile, or a file inside a dot-directory (.git, .venv, ...) under root."""
    return any(part.startswith(".") for part in file.relative_to(root).parts)


# Left out of the default corpus: installed packages (walking site-packages would also triple the
# time of every reuse of the token cache, which lists the files to fingerprint them), and the
# code-page tables of `encodings` (1.4 of the 30 MiB: tables of '\x00' -> NULL lines
# that a small model's samples drifted into).
STDLIB_LEFT_OUT = ("site-packages", "encodings")


def _stdlib_files(root: pathlib.Path) -> Iterator[pathlib.Path]:
    """The .py files under root, not descending into STDLIB_LEFT_OUT."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_LEFT_OUT]
        yield from (pathlib.Path(folder, name) for name in names if name.endswith(".py"))


def _candidates(path: str) -> tuple[pathlib.Path, list[pathlib.Path], list[pathlib.Path]]:
    """(the root; the source's files in a fixed, sorted order; the hidden files of a directory
    left out). DataError if the path does not exist."""
    if not path:
        root = default_corpus_root()
        return root, sorted(_stdlib_files(root)), []
    target = pathlib.Path(path)
    if target.is_file():
        return target, [target], []
    if target.is_dir():
        files = sorted(p for p in target.rglob("*") if p.is_file())
        hidden = [p for p in files if _is_hidden(p, target)]
        return target, [p for p in files if not _is_hidden(p, target)], hidden
    raise DataError(f"data path {path!r} does not exist (it is neither a file nor a directory)")


def corpus_files(path: str = "") -> list[pathlib.Path]:
    """The files that make up the source, in a fixed (sorted) order."""
    return _candidates(path)[1]


def source_bytes(path: str = "", max_bytes: int = 0) -> int:
    """The source's size on disk (its files' sizes, without reading them), at most max_bytes if
    given: what a sample of it is spread over (tokenizer.sampled)."""
    total = 0
    for file in corpus_files(path):
        try:
            total += file.stat().st_size
        except OSError:
            continue
    return min(total, max_bytes) if max_bytes else total


def source_fingerprint(path: str, text_field: str = "text", max_bytes: int = 0) -> str:
    """A hex digest of what the source's documents depend on, without reading any file: the sorted
    (relative path, size, mtime_ns) of its files, text_field and the size cap (max_bytes, 0 for
    none). It changes when a file is added, removed or modified (a rewrite moves mtime_ns even at
    the same size)."""
    root, files, _ = _candidates(path)
    entries = []
    for file in files:
        try:
            stat = file.stat()
            entries.append([str(file.relative_to(root)) if file != root else file.name, stat.st_size, stat.st_mtime_ns])
        except OSError:     # unreadable now: skipped when read, and a different source if it returns
            entries.append([str(file), -1, -1])
    # The cap is named as "no cap" (null) when 0: a digest that once held a fixed 256 MiB cap here
    # must never match a source read whole.
    blob = json.dumps([entries, text_field, max_bytes or None]).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def iter_documents(path: str, text_field: str = "text", report: CorpusReport | None = None,
                   text_field_name: str = "data.text_field", max_bytes: int = 0) -> Iterator[Document]:
    """The documents of the source at `path` ("" = the default corpus), in a fixed order.
    `text_field_name` is what an error tells the user to set (`tokenizer train`: --text-field).
    max_bytes > 0 caps the source by its files' sizes on disk: whole files are read in order, the
    one that reaches the cap included, and the rest are left out and reported; 0 reads it whole.

    `report` (if given) counts the files read and those left out as they are met. A path that does
    not exist is a DataError at once; malformed files are DataErrors naming the file (and line or
    row) when they are reached."""
    root, files, hidden = _candidates(path)   # before the generator: a missing path fails here
    report = report if report is not None else CorpusReport()
    report.source = report.source or source_name(path)
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0: no cap), got {max_bytes}")
    return _documents(root, files, hidden, text_field, report, single=root.is_file(), field_name=text_field_name,
                      max_bytes=max_bytes)


def _documents(root: pathlib.Path, files: list[pathlib.Path], hidden: list[pathlib.Path], text_field: str,
               report: CorpusReport, single: bool, field_name: str, max_bytes: int) -> Iterator[Document]:
    for file in hidden:
        report.skip(HIDDEN, file)
    total = 0
    for index, file in enumerate(files):
        if max_bytes and total >= max_bytes:
            for rest in files[index:]:
                report.skip(_over_cap(max_bytes), rest)
            return
        yielded = False
        try:
            size = file.stat().st_size
            if file.suffix in (".jsonl", ".parquet"):
                records = _jsonl(file, text_field, report, field_name) if file.suffix == ".jsonl" else \
                    _parquet(file, text_field, report, size, field_name)
                for doc in records:
                    yielded = True
                    yield doc
            else:
                data = file.read_bytes()
                size = len(data)
                if b"\0" in data:
                    if single:
                        raise DataError(f"data file {file} is not text (it contains NUL bytes)")
                    report.skip(NOT_TEXT, file, size=size)
                    continue
                report.bytes_read += size
                yield Document(str(file), data.decode("utf-8", errors="replace"))
        except OSError as exc:
            # A file named on its own must be usable; in a directory, an unreadable file is left
            # out and reported (a permissions slip should not stop a run over a thousand files).
            # One that failed after some of its records were read would be half in the corpus.
            if single or yielded:
                raise DataError(f"data file {file} cannot be read: {exc.strerror or exc}") from exc
            report.skip(UNREADABLE, file, detail=exc.strerror or type(exc).__name__)
            continue
        report.files_read += 1
        total += size


def _jsonl(file: pathlib.Path, text_field: str, report: CorpusReport, field_name: str) -> Iterator[Document]:
    """One document per non-empty line; report.bytes_read grows line by line (for progress)."""
    for where, text in jsonl_texts(file, text_field, f"set {field_name} to the field that holds the text",
                                   on_line=lambda size: setattr(report, "bytes_read", report.bytes_read + size)):
        yield Document(where, text)


def jsonl_records(file: pathlib.Path, on_line=None, what: str = "record") -> Iterator[tuple[str, dict]]:
    """(FILE:LINE, the JSON object) for every non-empty line of a .jsonl file, read line by line;
    on_line(bytes) is called for each line read. DataError naming the file and line for a line
    that is not a JSON object, and naming the file if it holds none."""
    found = False
    with pathlib.Path(file).open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if on_line is not None:
                on_line(len(raw))
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            where = f"{file}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not a JSON line ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: a JSON {type(record).__name__}, not an object")
            found = True
            yield where, record
    if not found:
        raise DataError(f"{file}: an empty jsonl file (no {what} in it)")


def jsonl_texts(file: pathlib.Path, field: str, hint: str, on_line=None) -> Iterator[tuple[str, str]]:
    """(FILE:LINE, the string in `field`) for every non-empty line of a .jsonl file (jsonl_records);
    DataError naming the file and line for a record that lacks the field (`hint` says how to
    name another) or holds a non-string."""
    for where, record in jsonl_records(file, on_line, what="documents"):
        yield where, record_text(where, record, field, hint)


def record_text(where: str, record: dict, field: str, hint: str) -> str:
    """The string in `field` of a jsonl record; DataError naming the line if it is missing or not a string."""
    if field not in record:
        fields = ", ".join(map(repr, list(record)[:10])) or "none"
        raise DataError(f"{where}: no {field!r} field (the record has: {fields}); {hint}")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not a string")
    return text


def _parquet(file: pathlib.Path, text_field: str, report: CorpusReport, size: int,
             field_name: str) -> Iterator[Document]:
    """One document per row of the text_field column, a record batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(file)
    except (pa.ArrowException, ValueError) as exc:
        raise DataError(f"{file}: not a readable parquet file ({exc})") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{file}: no {text_field!r} column (the file has: {', '.join(map(repr, columns)) or 'none'}); "
                        f"set {field_name} to the column that holds the text")
    kind = table.schema_arrow.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{file}: column {text_field!r} holds {kind}, not strings")
    rows = max(table.metadata.num_rows, 1)
    row, counted = 0, 0
    try:
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise DataError(f"{file}:{row}: field {text_field!r} is null, not a string")
                yield Document(f"{file}:{row}", text)
                row += 1
            # Progress by the share of rows read (a parquet file is compressed: no byte offsets).
            done = size * row // rows
            report.bytes_read += done - counted
            counted = done
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{file}: not a readable parquet file ({exc})") from None
    report.bytes_read += size - counted
