"""A worker's compiled programs in jax's persistent compilation cache: where, and from every host.

Where: unless JAX_COMPILATION_CACHE_DIR names a cache, the machine's, COMPILED under the cache
root (pod_worker/schema/caches.py), set before jax starts (default_cache_env, in main.py). So
a restarted worker loads its step instead of compiling it again, and every later run on the
machine (each `multipod local` and `multipod generate` starts new workers) loads what an earlier
one compiled. jax bounds it (COMPILE_CACHE_MAX_BYTES unless JAX_COMPILATION_CACHE_MAX_SIZE says
otherwise), dropping the programs read least recently; bounded, it also locks the folder around
each read and write, so that workers of runs side by side never read a program half written.
Every program is kept however quick its compile: tiny ones add up to seconds at a start.

From every host:

jax writes cache entries from process 0 only: on TPU every process computes the same key, and one
writer spares a shared filesystem concurrent writes of the same file. On CPU the key also hashes
the host's own devices and compile options, so the hosts of a pod never share a key: host 0 finds
its programs again after a restart or in the next run, and every other host compiled all of them
anew every time (measured: a 2-host pod's warm configure took 35 s against 4 s for a 1-host pod,
host 1 compiling the step, the update and the checksum again). Each host's keys are its own, so
letting each host write them contends for nothing.

This reaches into jax's private compiler module (there is no public switch); on a jax without
those names it does nothing and says so once.

After a kill: jax's bounded cache writes a program, then its access-time file, under the folder's
lock. A process killed between the two (a SIGKILLed pod, a Ctrl-C, the OOM killer) leaves a program
without its access time, perhaps cut short, and jax 0.10's eviction, which reads every access time
before each write, then fails every later write on the machine: the cache stops growing, with a
warning at each compile that says only "Error writing persistent compilation cache entry" (jax
issue 39880, fixed after 0.10.2). A worker therefore removes such entries at its start, under the
same lock (remove_orphans): a program lost that way compiles once more.
"""
from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping

from multipod.pod_worker.schema.caches import compiled_cache_dir

log = logging.getLogger(__name__)

# The default bound on the machine's cache. The default model's programs take about 1 MiB.
COMPILE_CACHE_MAX_BYTES = 2 << 30


def default_cache_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment gets, before jax starts, for the machine's compilation cache:
    nothing if JAX_COMPILATION_CACHE_DIR names a cache already."""
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(compiled_cache_dir(environ)),
            "JAX_COMPILATION_CACHE_MAX_SIZE": environ.get("JAX_COMPILATION_CACHE_MAX_SIZE",
                                                          str(COMPILE_CACHE_MAX_BYTES)),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


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


# jax's names for an entry's two files (jax._src.lru_cache._CACHE_SUFFIX and _ATIME_SUFFIX) and
# for the folder's lock file.
_PROGRAM, _ACCESS_TIME, _LOCK = "-cache", "-atime", ".lockfile"


def remove_orphans(environ: Mapping[str, str], timeout_s: float = 10.0) -> int:
    """Delete the entries of the bounded compilation cache that `environ` names
    (JAX_COMPILATION_CACHE_DIR, with JAX_COMPILATION_CACHE_MAX_SIZE set: only a bounded cache keeps
    access times) whose access-time file is missing: what a process killed in the middle of a
    write leaves, and what makes jax 0.10 fail every later write (the module's docstring). Under
    jax's own lock on the folder, so a write in progress is never taken for one. Returns how many
    were removed; a cache that is absent, unbounded or locked for longer than `timeout_s` is left
    as it is (it only costs compile time)."""
    folder, bound = environ.get("JAX_COMPILATION_CACHE_DIR"), environ.get("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
    if not folder or bound.strip() in ("", "-1") or not os.path.isdir(folder):
        return 0
    import filelock
    lock = filelock.FileLock(os.path.join(folder, _LOCK))
    try:
        lock.acquire(timeout=timeout_s)
    except (filelock.Timeout, OSError) as exc:
        log.warning("could not check the compilation cache %s for entries a killed process left: %s", folder, exc)
        return 0
    try:
        names = set(os.listdir(folder))
        orphans = [name for name in names
                   if name.endswith(_PROGRAM) and name[:-len(_PROGRAM)] + _ACCESS_TIME not in names]
        for name in orphans:
            pathlib.Path(folder, name).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove entries a killed process left in the compilation cache %s: %s", folder, exc)
        return 0
    finally:
        lock.release()
    if orphans:
        log.warning("removed %d program(s) a killed process left half written in the compilation cache %s (they "
                    "compile again once); jax would otherwise have stopped writing to it", len(orphans), folder)
    return len(orphans)
