"""Shared e2e fixtures."""
from __future__ import annotations

import pytest

from tests.helpers import cli_env


@pytest.fixture(scope="session")
def cached_env() -> dict:
    """The CLI's environment, which carries the session's persistent compilation cache
    (tests/conftest.py) to every e2e run and every restarted worker: only the first run of a
    model compiles its steps."""
    env = cli_env()
    assert env.get("JAX_COMPILATION_CACHE_DIR"), "tests/conftest.py sets the session's compilation cache"
    return env


@pytest.fixture(scope="session")
def env(cached_env) -> dict:
    """The environment e2e runs use unless a module defines its own (test_recovery adds its hooks)."""
    return cached_env
