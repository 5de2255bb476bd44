"""What the data cache holds, and pruning what no run has used for a while (`multipod cache`).

The cache root (data.cache_dir, else $MULTIPOD_CACHE_DIR, else ~/.cache/multipod) holds:
- `tokens/<key>/`: a token cache (token_cache.py), one per source, tokenizer and text field;
- `tokenizers/<key>/tokenizer.json`: a "bpe:N" tokenizer trained on a corpus (corpus.py);
- `tokens/.<key>.tmp-*`: the build folder of a token cache, left by a process killed mid-build;
- `jax/`: jax's persistent compilation cache of the machine's workers (pod_worker/compile_cache.py),
  which jax itself bounds (evicting the least recently used programs); it counts as used when
  a program in it was last read or written.
A corpus that changes gets a new key, so old entries are never reused, only kept. Every open of
an entry marks it used (the folder's modification time), and `prune` removes the entries not
used for a given time: a run that needs one again rebuilds it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time

from multipod.pod_worker.schema import COMPILED, default_cache_root

# A build folder touched within this many seconds may belong to a build still running.
BUILD_IN_PROGRESS_S = 3600.0


def default_root() -> pathlib.Path:
    """$MULTIPOD_CACHE_DIR, else ~/.cache/multipod (data.cache_dir overrides both in a run)."""
    return default_cache_root()


def compiled_dir(root: pathlib.Path) -> pathlib.Path:
    """The compilation cache's folder under the cache root `root` (the workers')."""
    return root / COMPILED


def mark_used(directory: pathlib.Path) -> None:
    """Record that a run used the cache entry in `directory` now (a read-only cache stays as it is)."""
    try:
        os.utime(directory)
    except OSError:
        pass


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One entry of the cache: kind is "tokens", "tokenizer", "unfinished build" or
    "compiled programs"."""
    kind: str
    path: pathlib.Path
    size_bytes: int
    last_used: float        # seconds since the epoch
    describes: str          # what it was made from

    def age_days(self, now: float) -> float:
        """Days since a run last used it."""
        return max(0.0, now - self.last_used) / 86400.0


def _size(folder: pathlib.Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            continue        # removed meanwhile
    return total


def _newest(folder: pathlib.Path) -> float:
    """The latest modification time of `folder` and the files in it."""
    newest = 0.0
    for path in [folder, *folder.iterdir()]:
        try:
            newest = max(newest, path.stat().st_mtime)
        except OSError:
            continue        # evicted meanwhile
    return newest


def _token_cache_describes(folder: pathlib.Path) -> str:
    try:
        index = json.loads((folder / "index.json").read_text())
        capped = f" (its first {index['max_bytes']:,} bytes: data.max_bytes)" if index.get("max_bytes") else ""
        return f"{index['source'] or 'the default corpus'}{capped}, tokenizer {index['tokenizer']['name']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable index.json (a run removes and rebuilds it)"


def entries(root: pathlib.Path) -> list[CacheEntry]:
    """Every entry under `root`, least recently used first (an empty list if there is no cache)."""
    found = []
    kinds = (("tokens", "tokens"), ("tokenizers", "tokenizer"))
    for folder_name, kind in kinds:
        parent = root / folder_name
        if not parent.is_dir():
            continue
        for folder in parent.iterdir():
            if not folder.is_dir():
                continue
            try:
                last_used = folder.stat().st_mtime
            except OSError:
                continue
            if folder.name.startswith("."):
                entry_kind, describes = "unfinished build", "a token cache whose build did not finish"
            elif kind == "tokens":
                entry_kind, describes = kind, _token_cache_describes(folder)
            else:
                entry_kind, describes = kind, "a BPE trained on a corpus"
            found.append(CacheEntry(entry_kind, folder, _size(folder), last_used, describes))
    compiled = compiled_dir(root)
    if compiled.is_dir():
        # jax rewrites a program's "-atime" file at every read: the newest file is the last use.
        found.append(CacheEntry("compiled programs", compiled, _size(compiled), _newest(compiled),
                                "jax's compilation cache of this machine's workers"))
    return sorted(found, key=lambda e: e.last_used)


def prune(root: pathlib.Path, older_than_days: float, dry_run: bool = False,
          now: float | None = None) -> list[CacheEntry]:
    """Remove (unless dry_run) the entries under `root` no run has used for `older_than_days`;
    returns them. A build folder touched within BUILD_IN_PROGRESS_S stays, whatever the age asked."""
    if not older_than_days >= 0:
        raise ValueError(f"--older-than-days must be 0 or more, got {older_than_days}")
    now = time.time() if now is None else now
    chosen = []
    for entry in entries(root):
        idle_s = now - entry.last_used
        if idle_s < older_than_days * 86400.0:
            continue
        if entry.kind == "unfinished build" and idle_s < BUILD_IN_PROGRESS_S:
            continue
        chosen.append(entry)
        if not dry_run:
            shutil.rmtree(entry.path, ignore_errors=True)
    return chosen


def table(found: list[CacheEntry], now: float | None = None) -> str:
    """The entries as lines for a terminal: size, days since used, kind, path, what it is."""
    now = time.time() if now is None else now
    lines = [f"{e.size_bytes / 2**20:9.1f} MiB  {e.age_days(now):6.1f} days  {e.kind:<16} {e.path}  ({e.describes})"
             for e in found]
    total = sum(e.size_bytes for e in found)
    lines.append(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {total / 2**20:.1f} MiB")
    return "\n".join(lines)
