"""The cache root both sides keep their caches under: $MULTIPOD_CACHE_DIR, else
~/.cache/multipod. The controller keeps its token caches and trained tokenizers there
(controller/data/cache_store.py), a worker its compiled programs, in COMPILED
(pod_worker/compile_cache.py) unless JAX_COMPILATION_CACHE_DIR names another folder."""
from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

COMPILED = "jax"     # the folder of jax's persistent compilation cache under the root


def default_cache_root(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """$MULTIPOD_CACHE_DIR, else ~/.cache/multipod, in `environ` (default: this process's)."""
    chosen = (os.environ if environ is None else environ).get("MULTIPOD_CACHE_DIR")
    return pathlib.Path(chosen) if chosen else pathlib.Path.home() / ".cache" / "multipod"


def compiled_cache_dir(environ: Mapping[str, str]) -> pathlib.Path:
    """The folder of compiled programs that a worker started with `environ` uses: the one
    JAX_COMPILATION_CACHE_DIR names, else COMPILED under the cache root."""
    named = environ.get("JAX_COMPILATION_CACHE_DIR")
    return pathlib.Path(named) if named else (default_cache_root(environ) / COMPILED).absolute()
