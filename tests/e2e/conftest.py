"""Shared e2e fixtures."""
from __future__ import annotations

import pathlib

import pytest

from tests.helpers import cli_env

# An e2e test may wait for another test process's shared run (shared_runs.WAIT_S) and then run its
# own pods: on a loaded 2-core machine that outlasts the suite's 300 s cap (pyproject.toml), which
# is there to catch hangs. Each e2e wait has its own deadline below this one, which names what
# it waited for; this cap only stops a hang that none of them catches.
E2E_TIMEOUT_S = 1200
_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items):
    """Give the e2e tests E2E_TIMEOUT_S, unless a test sets its own."""
    for item in items:
        if _HERE in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


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
