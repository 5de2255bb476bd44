"""The marks of configurations whose programs the shared compilation cache of `multipod local`'s
workers holds: where they live, what tells two configurations apart, and that neither jax's
cache nor its orphan check minds them."""
from __future__ import annotations

import pathlib

from multipod.controller.cluster.compile_marks import MARKS, CompileMarks
from multipod.pod_worker.compile_cache import default_cache_env, remove_orphans
from multipod.pod_worker.schema.caches import compiled_cache_dir


def test_the_marks_live_in_the_cache_the_workers_use(tmp_path):
    named = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
    assert CompileMarks.of_workers(named).folder == tmp_path / "jax" / MARKS
    machine = {"MULTIPOD_CACHE_DIR": str(tmp_path / "root")}
    # The folder a worker started with this environment is given (default_cache_env).
    assert compiled_cache_dir(machine) == pathlib.Path(default_cache_env(machine)["JAX_COMPILATION_CACHE_DIR"])
    assert CompileMarks.of_workers(machine).folder == compiled_cache_dir(machine) / MARKS


def test_every_part_of_a_configuration_names_another_mark(tmp_path):
    marks = CompileMarks(tmp_path)
    base = ('{"model": 1}', 2, [2, 2], 1, True)
    key = marks.key(*base)
    assert key == marks.key(*base)
    others = [('{"model": 2}', 2, [2, 2], 1, True), ('{"model": 1}', 3, [2, 2, 2], 1, True),
              ('{"model": 1}', 2, [4, 4], 1, True), ('{"model": 1}', 2, [2, 2], 2, True),
              ('{"model": 1}', 2, [2, 2], 1, False)]
    assert len({key, *(marks.key(*o) for o in others)}) == 6
    assert not marks.holds(key)
    marks.add(key)
    assert marks.holds(key) and not marks.holds(marks.key(*others[0]))


def test_the_orphan_check_leaves_the_marks_and_the_programs_alone(tmp_path):
    folder = tmp_path / "jax"
    marks = CompileMarks(folder)
    marks.add(marks.key("{}", 2, [1, 1], 1, False))
    (folder / "jit_step-1-cache").write_bytes(b"program")
    (folder / "jit_step-1-atime").write_bytes(b"0")
    env = {"JAX_COMPILATION_CACHE_DIR": str(folder), "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 20)}
    assert remove_orphans(env) == 0
    assert sorted(p.name for p in folder.iterdir() if p.name != ".lockfile") == [
        "jit_step-1-atime", "jit_step-1-cache", MARKS]
