"""Which pod configurations the shared compilation cache of pods on one machine (`multipod local`)
already holds, so that the pods configure all at once when it does.

Pods on one machine share one persistent compilation cache (pod_worker/compile_cache.py). On a
cold cache pod 0 configures first and the others then load what it compiled: configured at once,
every pod would compile the same programs on cores they share. On a warm cache that order only
makes the others wait for pod 0 to load its programs (docs/benchmarks.md, "Pods configured at
once").

So after a configure the controller leaves a mark in the cache's folder, named by a hash of what
the pods' programs depend on: the worker config, the pod count, every pod's device count, the
hosts per pod, whether the run evaluates (the evaluation's program), whether the pods build an
initial state (the parameter init's program: a resumed run's pods do not) and jax's version. When the
mark is there, the next run configures every pod at once. A mark can outlive the programs (jax
evicts the least recently read when the cache is full, and a change of multipod's code changes
them): such a run then compiles its programs in every pod at once, once. The programs and the
run's results never depend on the order.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import pathlib
from collections.abc import Mapping, Sequence

from multipod.pod_worker.schema.caches import compiled_cache_dir

log = logging.getLogger(__name__)

# A folder inside the cache's: jax's eviction and compile_cache.remove_orphans only look at the
# files at its top level.
MARKS = "multipod-configured"


def _jax_versions() -> str:
    found = []
    for name in ("jax", "jaxlib"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


class CompileMarks:
    """The marks of configurations whose programs a cache folder holds."""

    def __init__(self, cache_folder: pathlib.Path):
        self.folder = pathlib.Path(cache_folder) / MARKS

    @classmethod
    def of_workers(cls, environ: Mapping[str, str]) -> CompileMarks:
        """The marks of the cache that workers started with `environ` use (`multipod local`'s)."""
        return cls(compiled_cache_dir(environ))

    @staticmethod
    def key(worker_config_json: str, num_pods: int, device_counts: Sequence[int], hosts_per_pod: int,
            evaluates: bool, initial_state: bool = True) -> str:
        """The name of a configuration's mark (initial_state: the pods build their initial state,
        whose init program the others do not compile)."""
        what = json.dumps([worker_config_json, num_pods, list(device_counts), hosts_per_pod, evaluates,
                           _jax_versions()] + ([] if initial_state else ["awaits_state"]))
        return hashlib.blake2b(what.encode(), digest_size=16).hexdigest()

    def holds(self, key: str) -> bool:
        """Whether a configure of this configuration succeeded with this cache before."""
        return (self.folder / key).is_file()

    def add(self, key: str) -> None:
        """Mark a configuration whose pods all configured. A cache folder that cannot take the
        mark only keeps the next run in the cold order."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / key).touch()
        except OSError as exc:
            log.info("could not mark the compilation cache %s: %s", self.folder, exc)
