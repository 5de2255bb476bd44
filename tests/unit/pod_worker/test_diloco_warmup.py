"""DiLoCo's configure-time warm-up (pod_worker/diloco_warmup.py, PodTrainer.warm_up_outer, run by
Pod._build): every fragment's outer programs compile at configure, so that no outer sync, the
first of each fragment included, compiles (or loads from the compilation cache) anything; and the
pods then train bitwise as pods configured without it."""
from __future__ import annotations

import contextlib

import jax
import pytest

from multipod.pod_worker import shared_programs
from multipod.pod_worker.trainer import PodTrainer, fingerprint
from tests.unit.pod_worker.test_diloco import Pods, _config, _local

_COMPILE = "/jax/core/compile/backend_compile_duration"   # each program compiled or loaded from the cache


@contextlib.contextmanager
def _compiles():
    """The names of the programs compiled (or loaded from the persistent cache) meanwhile, in this
    process: jit'd programs and eager operations alike."""
    names: list[str] = []

    def listen(event, _duration, **kwargs):
        if event == _COMPILE:
            names.append(kwargs.get("fun_name", "?"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _cache_sizes(pod) -> list[int]:
    """The compiled variants of each of the pod's outer programs (every fragment's, the agreed
    state's checksum, and the copy of the state a step waiting for an outer exchange keeps)."""
    trainer = pod.trainer
    sizes = [program._cache_size() for programs in trainer.outer._programs for program in programs.values()]
    return sizes + [trainer._outer_checksum._cache_size(), trainer._state_copy._cache_size()]


def _state(pod) -> tuple:
    trainer = pod.trainer
    return (trainer.checksum(), trainer.fingerprint(), _local(pod), trainer.step, trainer.outer.version,
            trainer.outer.applied, fingerprint(trainer.outer.states))


def _run(pods: Pods, steps: int) -> tuple[list, list[list]]:
    """Each step's (checksum, outer sync and fragment applied) on every pod, and each step's
    compiles."""
    outcomes, compiles = [], []
    for step in range(steps):
        with _compiles() as names:
            got = pods.step(step)
        outcomes.append([(o.checksum, o.outer and (o.outer.sync, o.outer.fragment, o.outer.pods)) for o in got])
        compiles.append(names)
    return outcomes, compiles


@pytest.mark.parametrize("count, sync", [
    (2, {"inner_steps": 4, "fragments": 2}),
    (2, {"inner_steps": 4, "fragments": 2, "overlap_steps": 1, "outer_dtype": "int4"}),
    (1, {"inner_steps": 4, "fragments": 2, "overlap_steps": 1}),
])
def test_the_first_outer_sync_of_every_fragment_compiles_nothing_and_the_run_stays_bitwise(count, sync, monkeypatch):
    config = _config(count, **sync)
    steps = 2 * config.sync.inner_steps + config.sync.overlap_steps    # every fragment's first two syncs applied
    warmed = Pods(config, count)
    try:
        sizes = [_cache_sizes(pod) for pod in warmed.pods]
        assert all(all(s) for s in sizes), f"a program was not warmed up: {sizes}"
        before = [_state(pod) for pod in warmed.pods]
        want, compiles = _run(warmed, steps)
        assert [_cache_sizes(pod) for pod in warmed.pods] == sizes
        assert compiles == [[]] * steps, f"steps compiled: {compiles}"
        after = [(_state(pod), fingerprint(pod.trainer.outer.agreed)) for pod in warmed.pods]
    finally:
        warmed.close()
    applied = [o[0][1][:2] for o in want if o[0][1]]
    assert applied == [(1, 0), (2, 1), (3, 0), (4, 1)]
    # Without the warm-up: the same state at configure, and the very same run after it.
    monkeypatch.setattr(PodTrainer, "warm_up_outer", lambda self: None)
    # As in a process of their own: the warmed pods' programs, which every trainer of this process
    # with the same layout shares, are not the cold pods' (shared_programs.py).
    shared_programs.clear()
    cold = Pods(config, count)
    try:
        assert [_state(pod) for pod in cold.pods] == before
        got, cold_compiles = _run(cold, steps)
        assert got == want
        assert [(_state(pod), fingerprint(pod.trainer.outer.agreed)) for pod in cold.pods] == after
    finally:
        cold.close()
    # ... where the outer syncs compiled their programs as they came (what the counting catches).
    syncs = [step for step, o in enumerate(want) if o[0][1]]
    assert all(cold_compiles[step] for step in syncs[:2]), cold_compiles
