"""Documents from a source: text files, directories, jsonl and parquet; the corpus report; and a
clear error naming the file for each kind of bad input."""
import json
import os
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from multipod.controller.data import sources
from multipod.controller.data.batches import DataError
from multipod.controller.data.sources import CorpusReport, Document, corpus_files, iter_documents, source_fingerprint

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode", "", "two\nlines\n"]


def write_jsonl(file: pathlib.Path, records) -> pathlib.Path:
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    return file


def write_parquet(file: pathlib.Path, columns: dict, row_group_size: int | None = None) -> pathlib.Path:
    pq.write_table(pa.table(columns), file, row_group_size=row_group_size)
    return file


def texts(path, **kwargs) -> list[str]:
    return [doc.text for doc in iter_documents(str(path), **kwargs)]


def test_jsonl_and_parquet_give_the_same_documents_as_text_files(tmp_path, monkeypatch):
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"{i:02d}.txt").write_text(text)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    # Small record batches: the reader goes batch by batch, across row groups.
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 3)
    parquet = write_parquet(tmp_path / "docs.parquet", {"text": TEXTS, "n": list(range(len(TEXTS)))}, row_group_size=2)
    assert texts(folder) == texts(jsonl) == texts(parquet) == TEXTS
    assert [d.source for d in iter_documents(str(jsonl))] == [f"{jsonl}:{n}" for n in range(1, 5)]
    assert [d.source for d in iter_documents(str(parquet))] == [f"{parquet}:{n}" for n in range(4)]


def test_a_directory_mixes_formats_in_sorted_order_with_a_custom_text_field(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("plain")
    write_jsonl(tmp_path / "b.jsonl", [{"body": "j1"}, {"body": "j2"}])
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text() + "\n   \n")   # blank lines are skipped
    write_parquet(tmp_path / "sub" / "c.parquet", {"body": ["p1", "p2"]})
    report = CorpusReport()
    docs = list(iter_documents(str(tmp_path), text_field="body", report=report))
    assert [d.text for d in docs] == ["plain", "j1", "j2", "p1", "p2"]
    assert docs[0] == Document(str(tmp_path / "a.txt"), "plain")
    assert docs[2].source == f"{tmp_path / 'b.jsonl'}:2" and docs[4].source == f"{tmp_path / 'sub' / 'c.parquet'}:1"
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert (report.source, report.files_read, report.bytes_read) == (str(tmp_path), 3, on_disk)


@pytest.mark.parametrize("name, write, message", [
    ("empty.jsonl", lambda f: f.write_text(""), r"empty\.jsonl: an empty jsonl file"),
    ("blank.jsonl", lambda f: f.write_text("\n  \n"), r"blank\.jsonl: an empty jsonl file"),
    ("notjson.jsonl", lambda f: f.write_text('{"text": "ok"}\n{"text": oops}\n'), r"notjson\.jsonl:2: not a JSON line"),
    ("list.jsonl", lambda f: f.write_text('["text"]\n'), r"list\.jsonl:1: a JSON list, not an object"),
    ("nofield.jsonl", lambda f: write_jsonl(f, [{"text": "a"}, {"content": "b", "id": 2}]),
     r"nofield\.jsonl:2: no 'text' field \(the record has: 'content', 'id'\)"),
    ("number.jsonl", lambda f: write_jsonl(f, [{"text": 3}]), r"number\.jsonl:1: field 'text' is int, not a string"),
    ("corrupt.parquet", lambda f: f.write_bytes(os.urandom(2000)), r"corrupt\.parquet: not a readable parquet file"),
    ("nocolumn.parquet", lambda f: write_parquet(f, {"body": ["x"], "id": [1]}),
     r"nocolumn\.parquet: no 'text' column \(the file has: 'body', 'id'\)"),
    ("ints.parquet", lambda f: write_parquet(f, {"text": [1, 2]}),
     r"ints\.parquet: column 'text' holds int64, not strings"),
    ("null.parquet", lambda f: write_parquet(f, {"text": ["a", None]}), r"null\.parquet:1: field 'text' is null"),
    ("binary.txt", lambda f: f.write_bytes(b"\0\1\2"), r"binary\.txt is not text"),
])
def test_bad_input_is_an_error_naming_the_file(tmp_path, name, write, message):
    write(tmp_path / name)
    with pytest.raises(DataError, match=message):
        list(iter_documents(str(tmp_path / name)))


def test_a_malformed_file_inside_a_directory_is_an_error_too(tmp_path):
    (tmp_path / "a.txt").write_text("fine")
    write_jsonl(tmp_path / "b.jsonl", [{"txt": "typo"}])
    with pytest.raises(DataError, match=r"b\.jsonl:1: no 'text' field \(the record has: 'txt'\)"):
        list(iter_documents(str(tmp_path)))


def test_a_missing_path_fails_at_once(tmp_path):
    with pytest.raises(DataError, match=r"missing' does not exist"):
        iter_documents(str(tmp_path / "missing"))      # not only when iterated
    with pytest.raises(DataError, match="does not exist"):
        source_fingerprint(str(tmp_path / "missing"))


def test_a_single_unreadable_file_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)
    with pytest.raises(DataError, match=r"a\.txt cannot be read: Permission denied"):
        list(iter_documents(str(tmp_path / "a.txt")))


def test_the_loader_reports_what_it_read_and_what_it_skipped(tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("[core]\n")       # inside a hidden directory
    (root / ".notes").write_text("private\n")
    (root / "a.txt").write_text("a" * 600)
    (root / "b.bin").write_bytes(b"\x00\x01" * 100)         # binary: a NUL byte
    (root / "c.txt").write_text("c" * 50)                   # unreadable, below
    (root / "d.txt").write_text("d" * 600)                  # reaches the cap: the last file read
    (root / "e.txt").write_text("e" * 700)
    (root / "f.txt").write_text("f" * 800)
    read_bytes = pathlib.Path.read_bytes

    def unreadable_c(self):
        if self.name == "c.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)
    monkeypatch.setattr(pathlib.Path, "read_bytes", unreadable_c)

    report = CorpusReport()
    assert texts(root, report=report, max_bytes=1000) == ["a" * 600, "d" * 600]
    line = report.summary()
    assert line.startswith(f"corpus {root}: read 2 file(s) (1.2 KiB); skipped 6 file(s) (1.7 KiB): "), line
    assert "2 over the data.max_bytes cap of 1000 B: e.txt, f.txt" in line
    assert "1 unreadable: c.txt (Permission denied)" in line
    assert "1 not text (contain NUL bytes): b.bin" in line
    assert "2 hidden: .git/config, .notes" in line
    assert (report.files_read, report.bytes_read) == (2, 1200)
    skipped = {why: (s.files, s.bytes) for why, s in report.skipped.items()}
    assert skipped == {sources.HIDDEN: (2, 15), sources.NOT_TEXT: (1, 200), sources.UNREADABLE: (1, 50),
                       "over the data.max_bytes cap of 1000 B": (2, 1500)}
    # Without a cap (the default) every text file is read, however large the source.
    whole = CorpusReport()
    assert texts(root, report=whole) == ["a" * 600, "d" * 600, "e" * 700, "f" * 800]
    assert not any("cap" in why for why in whole.skipped)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        iter_documents(str(root), max_bytes=-1)


def test_the_default_corpus_is_the_stdlib_and_skips_nothing():
    files = corpus_files("")
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    report = CorpusReport()
    count = sum(1 for _ in iter_documents("", report=report))
    assert count == len(files) == report.files_read
    assert report.summary() == f"corpus {sources.default_corpus_root()}: read {len(files):,} file(s) " \
                               f"({sources._size(report.bytes_read)}); nothing skipped"


def test_the_fingerprint_follows_the_files_without_reading_them(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("one")
    first = source_fingerprint(str(tmp_path))
    assert source_fingerprint(str(tmp_path)) == first
    assert source_fingerprint(str(tmp_path), text_field="body") != first
    # A cap reads another corpus (up to its size) than the whole source, and one cap another than the next.
    assert len({first, *(source_fingerprint(str(tmp_path), max_bytes=cap) for cap in (2, 3))}) == 3
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: pytest.fail("read"))
    stat = (tmp_path / "a.txt").stat()
    (tmp_path / "a.txt").write_text("two")                  # same size, new content and mtime
    os.utime(tmp_path / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    modified = source_fingerprint(str(tmp_path))
    assert modified != first
    (tmp_path / "b.txt").write_text("added")
    added = source_fingerprint(str(tmp_path))
    assert added not in (first, modified)
    (tmp_path / "b.txt").unlink()
    assert source_fingerprint(str(tmp_path)) == modified
    (tmp_path / ".hidden").write_text("not part of the source")
    assert source_fingerprint(str(tmp_path)) == modified


def test_a_file_failing_after_some_of_its_records_is_an_error_not_half_a_file(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "b.txt").write_text("three")
    real = sources._jsonl

    def breaks_midway(file, text_field, report, field_name):
        documents = real(file, text_field, report, field_name)
        yield next(documents)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sources, "_jsonl", breaks_midway)
    with pytest.raises(DataError, match="a.jsonl cannot be read: Input/output error"):
        list(sources.iter_documents(str(tmp_path)))
