"""shared_programs.shared: equal arguments (configs, meshes, pytrees of shardings) give back the
same programs, so jax's caches hit across trainers; other arguments get their own; the set kept
is bounded; clear() starts afresh."""
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multipod.pod_worker import shared_programs
from multipod.pod_worker.shared_programs import shared
from tests.helpers import tiny_worker_config


def _sharding(device: int, spec: PartitionSpec | None = None):
    return NamedSharding(Mesh(np.array(jax.devices()[device:device + 1]), ("data",)), spec or PartitionSpec())


def test_equal_arguments_give_the_same_programs_and_others_their_own():
    made = []

    @shared
    def factory(config, shardings):
        made.append(1)
        return object()

    config = tiny_worker_config().model
    tree = {"a": _sharding(0), "b": [_sharding(0, PartitionSpec("data"))]}
    first = factory(config, tree)
    # Equal, not identical: another config object of the same value, a rebuilt tree.
    again = factory(dataclasses.replace(config), {"a": _sharding(0), "b": [_sharding(0, PartitionSpec("data"))]})
    assert again is first and len(made) == 1
    assert factory(dataclasses.replace(config, n_layers=3), tree) is not first
    assert factory(config, {"a": _sharding(1), "b": [_sharding(1, PartitionSpec("data"))]}) is not first
    assert factory(config, {"a": _sharding(0), "c": [_sharding(0, PartitionSpec("data"))]}) is not first
    assert len(made) == 4


def test_the_set_kept_is_bounded_and_clear_starts_afresh(monkeypatch):
    monkeypatch.setattr(shared_programs, "MAX_ENTRIES", 2)
    made = []

    @shared
    def factory(n):
        made.append(n)
        return object()

    one = factory(1)
    factory(2)
    assert factory(1) is one            # used again: now the most recent
    factory(3)                          # drops 2, the least recently used
    assert factory(1) is one and len(made) == 3
    factory(2)
    assert made == [1, 2, 3, 2]
    shared_programs.clear()
    assert factory(1) is not one and made[-1] == 1


def test_trainers_of_one_layout_share_their_checksum_program():
    from multipod.pod_worker.trainer import PodTrainer
    first, second = (PodTrainer(tiny_worker_config(), jax.devices()[:1]) for _ in range(2))
    assert first._checksum is second._checksum
    assert first.checksum() == second.checksum()
    other = PodTrainer(tiny_worker_config(), jax.devices()[1:2])
    assert other._checksum is not first._checksum and other.checksum() == first.checksum()
