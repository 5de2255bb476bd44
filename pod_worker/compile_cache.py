"""Every host of a pod keeps its compiled programs in the persistent compilation cache.

jax writes cache entries from process 0 only: on TPU every process computes the same key, and one
writer spares a shared filesystem concurrent writes of the same file. On CPU the key also hashes
the host's own devices and compile options, so the hosts of a pod never share a key: host 0 finds
its programs again after a restart or in the next run, and every other host compiled all of them
anew every time (measured: a 2-host pod's warm configure took 35 s against 4 s for a 1-host pod,
host 1 compiling the step, the update and the checksum again). Each host's keys are its own, so
letting each host write them contends for nothing.

This reaches into jax's private compiler module (there is no public switch); on a jax without
those names it does nothing and says so once.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def let_this_host_write(process_id: int) -> bool:
    """Have this process (host `process_id` of a pod) write its compiled programs to the cache as
    host 0 does. Returns whether the cache writer was replaced (host 0 needs nothing)."""
    if process_id == 0:
        return False
    try:
        from jax._src import compilation_cache, compiler, config as jax_config
        put = compilation_cache.put_executable_and_time
        min_seconds = jax_config.persistent_cache_min_compile_time_secs
        _ = compiler._cache_write    # the writer replaced below must exist
    except (ImportError, AttributeError) as exc:
        log.info("host %d will not write the compilation cache (this jax has no %s)", process_id, exc)
        return False

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks) -> None:
        # jax's own rules but the process check: programs with host callbacks (jax.debug.print)
        # cannot be serialized, and programs quicker to compile than the threshold are not kept.
        if host_callbacks or compile_time_secs < min_seconds.value:
            return
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as exc:   # noqa: BLE001 - a cache that cannot be written only costs time
            log.warning("could not write %s to the compilation cache: %s", module_name, exc)

    compiler._cache_write = cache_write
    return True
