"""`multipod tune`'s grid: which layouts are tried, the argument types, a candidate applied to a config."""
import argparse
import json

import pytest

from multipod.controller.core.run_config import load_config
from multipod.controller.tune.grid import (
    Candidate,
    candidate_config,
    candidate_worker_json,
    enumerate_candidates,
    parse_bytes,
    parse_int_list,
    parse_mesh_list,
    parse_remat_list,
)
from multipod.model.config import ModelConfig, RematPolicy
from multipod.pod_worker.schema import WorkerConfig
from tests.helpers import TINY


def test_grid_covers_meshes_sequence_parallelism_microbatches_and_remat():
    model = ModelConfig(n_heads=8, mlp_dim=1024, vocab_size=256)
    candidates, skipped = enumerate_candidates(model, per_pod_batch=8, devices=4)
    meshes = {(c.data, c.model) for c in candidates}
    assert meshes == {(4, 1), (2, 2), (1, 4)}
    assert {c.remat for c in candidates} == {"none", "full", "selective"}
    # Sequence parallelism only where there is a model axis to split over.
    assert not any(c.sequence_parallel for c in candidates if c.model == 1)
    assert any(c.sequence_parallel for c in candidates if c.model == 2)
    # Microbatches split each data shard evenly: 8 rows over data=4 leaves 2 per device.
    assert {c.microbatches for c in candidates if c.data == 4} == {1, 2}
    assert {c.microbatches for c in candidates if c.data == 1} == {1, 2, 4, 8}
    assert len(set(candidates)) == len(candidates) and skipped == []


def test_grid_leaves_out_impossible_meshes_and_says_why():
    model = ModelConfig(n_heads=6, n_kv_heads=1, mlp_dim=96, vocab_size=96)
    candidates, skipped = enumerate_candidates(model, per_pod_batch=6, devices=4)
    assert {(c.data, c.model) for c in candidates} == {(2, 2)}
    assert any("mesh 1x4: model=4 does not divide n_heads=6" in line for line in skipped)
    assert any("mesh 4x1: data=4 does not divide the pod's batch of 6" in line for line in skipped)


def test_explicit_choices_are_tried_as_given():
    model = ModelConfig()
    candidates, _ = enumerate_candidates(model, 8, 4, meshes=[(2, 2)], microbatches=[3], remats=["selective"],
                                         sequence_parallel="on")
    assert candidates == [Candidate(2, 2, True, 3, "selective")]


def test_the_grid_uses_the_models_remat_policies():
    candidates, _ = enumerate_candidates(ModelConfig(), 8, 1)
    assert tuple(dict.fromkeys(c.remat for c in candidates)) == tuple(RematPolicy)


@pytest.mark.parametrize("text, value", [("1000", 1000), ("2KiB", 2048), ("1.5GiB", 3 * 2**29), ("3MB", 3_000_000)])
def test_memory_limit_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("parse, text, message", [
    (parse_bytes, "lots", "not a size: 'lots'"),
    (parse_int_list, "1,0", "expected positive integers"),
    (parse_int_list, "1,two", "expected comma-separated integers"),
    (parse_remat_list, "none,some", "remat policies are none, full, selective"),
    (parse_mesh_list, "2x2,4", "meshes look like DATAxMODEL"),
])
def test_bad_arguments_are_refused_with_a_reason(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_list_arguments():
    assert parse_int_list("1,2,4") == [1, 2, 4]
    assert parse_remat_list("none, full") == ["none", "full"]
    assert parse_mesh_list("2x2, 4x1") == [(2, 2), (4, 1)]


def test_a_candidate_applied_to_the_config_reaches_the_worker_config():
    base = load_config(TINY)
    candidate = Candidate(1, 2, True, 2, "full")
    config = candidate_config(base, candidate)
    assert (config.mesh.data, config.mesh.model) == (1, 2)
    assert (config.model.sequence_parallel, config.model.microbatches, config.model.remat) == (True, 2, "full")
    assert config.data == base.data and config.optimizer == base.optimizer
    # What the layout probe gets: the pod's WorkerConfig, as JSON it parses and validates.
    worker = WorkerConfig.from_json(candidate_worker_json(base, candidate))
    assert worker == config.worker_config()
    assert json.loads(candidate_worker_json(base, candidate))["mesh"] == {"data": 1, "model": 2}
