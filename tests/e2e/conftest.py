"""Shared e2e fixtures."""
from __future__ import annotations

import pytest

from tests.helpers import cli_env


@pytest.fixture(scope="session")
def cached_env(tmp_path_factory) -> dict:
    """The CLI's environment with one persistent compilation cache for every e2e run of the
    session (and every restarted worker): only the first run of a model compiles its steps."""
    return dict(cli_env(), JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache")),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


@pytest.fixture(scope="session")
def env(cached_env) -> dict:
    """The environment e2e runs use unless a module defines its own (test_recovery adds its hooks)."""
    return cached_env
