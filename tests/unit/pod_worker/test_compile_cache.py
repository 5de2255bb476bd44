"""pod_worker/compile_cache.py: a worker's cache is the machine's, under the cache root, bounded,
unless the environment names one; a host other than host 0 writes its compiled programs to it,
by jax's rules but the process check; and what a killed process left half written is removed, so
that jax goes on writing to it."""
from __future__ import annotations

import concurrent.futures
import logging
import pathlib

import filelock
import jax
import pytest
from jax._src import compilation_cache, compiler
from jax._src.lru_cache import LRUCache

from multipod.pod_worker.compile_cache import (
    COMPILE_CACHE_MAX_BYTES,
    default_cache_env,
    let_this_host_write,
    remove_orphans,
)


def test_a_worker_uses_the_machine_s_bounded_cache_beside_the_token_caches(tmp_path):
    env = default_cache_env({"MULTIPOD_CACHE_DIR": str(tmp_path)})
    assert env == {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
                   "JAX_COMPILATION_CACHE_MAX_SIZE": str(COMPILE_CACHE_MAX_BYTES),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    # Without MULTIPOD_CACHE_DIR, the user's ~/.cache/multipod.
    home = pathlib.Path.home() / ".cache" / "multipod" / "jax"
    assert default_cache_env({})["JAX_COMPILATION_CACHE_DIR"] == str(home)


def test_a_bound_or_a_cache_the_environment_names_is_kept(tmp_path):
    assert default_cache_env({"MULTIPOD_CACHE_DIR": str(tmp_path), "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"})[
        "JAX_COMPILATION_CACHE_MAX_SIZE"] == "-1"
    assert default_cache_env({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}) == {}


@pytest.fixture
def written(monkeypatch):
    """The entries the replaced writer hands to jax's cache; jax's own writer is put back after."""
    monkeypatch.setattr(compiler, "_cache_write", compiler._cache_write)
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    entries = []
    monkeypatch.setattr(compilation_cache, "put_executable_and_time",
                        lambda key, name, executable, backend, seconds: entries.append((key, name, seconds)))
    yield entries
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


def test_host_0_keeps_jax_s_writer(written):
    before = compiler._cache_write
    assert not let_this_host_write(0)
    assert compiler._cache_write is before


def test_another_host_writes_what_jax_would_keep(written):
    assert let_this_host_write(1)
    compiler._cache_write("jit_step-abc", 2.5, "jit_step", None, object(), [])
    compiler._cache_write("jit_print-abc", 2.5, "jit_print", None, object(), [object()])   # a host callback
    compiler._cache_write("jit_quick-abc", 0.2, "jit_quick", None, object(), [])           # under the threshold
    assert written == [("jit_step-abc", "jit_step", 2)]


def test_a_failed_write_costs_only_time(written, monkeypatch, caplog):
    def refuse(*args):
        raise OSError("disk full")
    monkeypatch.setattr(compilation_cache, "put_executable_and_time", refuse)
    assert let_this_host_write(1)
    compiler._cache_write("jit_step-abc", 2.5, "jit_step", None, object(), [])
    assert "disk full" in caplog.text


def _killed_mid_write(folder) -> LRUCache:
    """jax's bounded cache in `folder` with a whole entry and one program whose access time was
    never written, as a process killed between the two writes of jax's put leaves it."""
    cache = LRUCache(str(folder), max_size=1 << 20)
    cache.put("kept", b"y" * 10)
    cache.put("killed", b"x" * 10)
    (folder / "killed-atime").unlink()
    return cache


def test_what_a_killed_process_left_is_removed_so_jax_writes_the_cache_again(tmp_path, caplog):
    cache = _killed_mid_write(tmp_path)
    with pytest.raises(FileNotFoundError):      # jax 0.10: one such entry fails every later write
        cache.put("later", b"z" * 10)
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 20)}
    with caplog.at_level(logging.WARNING):
        assert remove_orphans(env) == 1
    assert "removed 1 program(s) a killed process left half written" in caplog.text
    cache.put("later", b"z" * 10)
    assert cache.get("later") == b"z" * 10 and cache.get("kept") == b"y" * 10 and cache.get("killed") is None
    assert remove_orphans(env) == 0


def test_an_unbounded_absent_or_held_cache_is_left_as_it_is(tmp_path, caplog):
    _killed_mid_write(tmp_path)
    assert remove_orphans({"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}) == 0      # unbounded: no access times
    assert remove_orphans({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "absent"),
                           "JAX_COMPILATION_CACHE_MAX_SIZE": "100"}) == 0
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_COMPILATION_CACHE_MAX_SIZE": "100"}
    with filelock.FileLock(str(tmp_path / ".lockfile")), caplog.at_level(logging.WARNING):
        # Another process's write in progress holds the lock: never taken for a killed one.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert pool.submit(remove_orphans, env, 0.2).result() == 0
    assert "could not check the compilation cache" in caplog.text
    assert (tmp_path / "killed-cache").exists()
