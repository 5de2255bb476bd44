"""`multipod local`'s workers and jax's persistent compilation cache (launch/local.py): the
machine's, under the cache root, bounded, unless the environment names one."""
from __future__ import annotations

import pathlib

from multipod.controller.launch.local import COMPILE_CACHE_MAX_BYTES, compile_cache_env


def test_the_workers_use_the_machine_s_bounded_cache_beside_the_token_caches(tmp_path):
    env = compile_cache_env({"MULTIPOD_CACHE_DIR": str(tmp_path)})
    assert env == {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
                   "JAX_COMPILATION_CACHE_MAX_SIZE": str(COMPILE_CACHE_MAX_BYTES),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    # Without MULTIPOD_CACHE_DIR, the user's ~/.cache/multipod.
    home = compile_cache_env({})["JAX_COMPILATION_CACHE_DIR"]
    assert home == str(pathlib.Path.home() / ".cache" / "multipod" / "jax")


def test_a_bound_or_a_cache_the_environment_names_is_kept(tmp_path):
    assert compile_cache_env({"MULTIPOD_CACHE_DIR": str(tmp_path), "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"})[
        "JAX_COMPILATION_CACHE_MAX_SIZE"] == "-1"
    assert compile_cache_env({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}) == {}
