"""What a large corpus costs before the first step: the tokenizer's training, the token cache's
build, and a later run's reuse of both, on a corpus of --mib MiB. Prints one JSON object.

    python -m bench.token_cache [--mib 256] [--tokenizer bpe:2048] [--repeats 1]

The corpus is the running Python's standard library (.py files, the default corpus) copied round
robin into a folder until it holds --mib MiB, so any size can be asked for on any machine. Each
repeat builds into a fresh cache root: train_tokenizer_s (bpe:N trains on the first
tokenizer.TRAIN_BYTES of the corpus whatever its size), build_s (tokenize every document and write
the shards), reuse_s (a later run: fingerprint the files, load the tokenizer, open the shards).
MB_per_s is the corpus's bytes over build_s. Medians over --repeats.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from multipod.controller.core.run_config import load_config
from multipod.controller.data import corpus, sources
from multipod.controller.data.token_cache import open_cache


def make_corpus(folder: pathlib.Path, mib: int) -> tuple[int, int]:
    """Copy the standard library's .py files round robin into `folder` until it holds `mib` MiB;
    (files, bytes)."""
    originals = sources.corpus_files("")
    target, total, count = mib << 20, 0, 0
    while total < target:
        for original in originals:
            size = original.stat().st_size
            if not size:
                continue
            copy = folder / f"{count // 1000:04d}" / f"{count:07d}.py"
            copy.parent.mkdir(exist_ok=True)
            shutil.copyfile(original, copy)
            total, count = total + size, count + 1
            if total >= target:
                break
    return count, total


def one_build(corpus_dir: pathlib.Path, tokenizer: str, work: pathlib.Path) -> dict:
    """Train the tokenizer and build the token cache into a fresh cache root, then reuse both."""
    root = pathlib.Path(tempfile.mkdtemp(dir=work, prefix="cache-"))
    config = load_config(None, [f'data.path="{corpus_dir}"', f'data.tokenizer="{tokenizer}"',
                                f'data.cache_dir="{root}"'])
    start = time.perf_counter()
    tok = corpus.resolve_tokenizer(config, root)
    trained = time.perf_counter()
    cache = open_cache(str(corpus_dir), tok, root, config.data.text_field, progress=False)
    built = time.perf_counter()
    again = open_cache(str(corpus_dir), corpus.resolve_tokenizer(config, root), root, config.data.text_field,
                       progress=False)
    reused = time.perf_counter()
    assert cache.built and not again.built
    result = {"train_tokenizer_s": trained - start, "build_s": built - trained, "reuse_s": reused - built,
              "tokens": len(cache.train) + len(cache.eval), "documents": sum(cache.documents.values()),
              "shards": len(cache.index["splits"]["train"]["shards"]) + len(cache.index["splits"]["eval"]["shards"])}
    shutil.rmtree(root)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the corpus's size (default 256: the old fixed cap)")
    parser.add_argument("--tokenizer", default="bpe:2048")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.mib < 1 or args.repeats < 1:
        parser.error("--mib and --repeats must be at least 1")
    work = pathlib.Path(tempfile.mkdtemp(prefix="multipod-bench-tokens-"))
    try:
        corpus_dir = work / "corpus"
        corpus_dir.mkdir()
        files, size = make_corpus(corpus_dir, args.mib)
        runs = []
        for _ in range(args.repeats):
            print(f"building the token cache of {size / 2**20:.0f} MiB ...", file=sys.stderr)
            with contextlib.redirect_stdout(sys.stderr):    # the run's own lines; stdout is the JSON
                runs.append(one_build(corpus_dir, args.tokenizer, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({
        "benchmark": "token_cache", "tokenizer": args.tokenizer, "corpus_bytes": size, "files": files,
        "repeats": args.repeats, "machine": f"{os.cpu_count()} cores", "load_average_after": os.getloadavg(),
        **{key: round(value, 3) if key.endswith("_s") else int(value) for key, value in median.items()},
        "MB_per_s": round(size / 1e6 / median["build_s"], 2),
        "tokens_per_s": round(median["tokens"] / median["build_s"]),
    }, indent=1))


if __name__ == "__main__":
    main()
