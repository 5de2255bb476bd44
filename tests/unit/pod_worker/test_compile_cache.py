"""pod_worker/compile_cache.py: a host other than host 0 writes its compiled programs to the
persistent compilation cache, by jax's rules but the process check."""
from __future__ import annotations

import jax
import pytest
from jax._src import compilation_cache, compiler

from multipod.pod_worker.compile_cache import let_this_host_write


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
