"""`multipod tune`: the grid, the ranked table with errors, the memory limit, deadlines, and a
written config that trains."""
import dataclasses
import json

import pytest

from multipod.controller.config import ModelConfig, load_config
from multipod.controller.tune import Candidate, config_toml, enumerate_candidates, parse_bytes
from tests.helpers import TINY, read_metrics, run_cli


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One small search: 2 devices, model axis 2 with sequence parallelism, microbatches 1 and 3
    (3 does not divide the batch of 8: those candidates must fail and say so), remat none/full."""
    out = tmp_path_factory.mktemp("tune")
    result = run_cli("tune", "--config", TINY, "--devices", "2", "--meshes", "1x2", "--sequence-parallel", "on",
                     "--microbatches", "1,3", "--remat", "none,full", "--steps", "2", "--peak-flops", "1e10",
                     "--json", str(out / "table.json"), "--out", str(out / "best.toml"))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result


def test_table_ranks_the_candidates_that_ran_and_keeps_the_errors(tuned):
    out, result = tuned
    report = json.loads((out / "table.json").read_text())
    rows = report["rows"]
    assert len(rows) == 4
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    assert [r["rank"] for r in ok] == [1, 2] and rows[:2] == ok  # the ones that ran come first
    assert [r["step_time_s"] for r in ok] == sorted(r["step_time_s"] for r in ok)
    for r in ok:
        assert r["error"] is None and r["microbatches"] == 1
        assert len(r["step_times_s"]) == 2 and r["tokens_per_s"] > 0
        assert r["memory_bytes"] > 0 and r["temp_bytes"] > 0
        assert 0 < r["mfu"] < r["hfu"]
    for r in failed:
        assert r["status"] == "error" and r["rank"] is None and r["microbatches"] == 3
        assert "model.microbatches: 3 does not divide" in r["error"]
    # Recomputation is in the hardware FLOPs, not the model FLOPs.
    flops = {r["remat"]: r["hardware_flops_per_step"] for r in ok}
    assert flops["full"] > flops["none"]
    assert ok[0]["model_flops_per_step"] == ok[1]["model_flops_per_step"]
    # The table and the DCN statement are printed, and progress went to stderr.
    assert "data-parallel" in result.stdout and "HFU" in result.stdout and "does not divide" in result.stdout
    assert "[4/4]" in result.stderr
    assert report["best"] == 1 and "data-parallel" in report["note"]


def test_best_config_trains(tuned, tmp_path):
    out, _ = tuned
    best = json.loads((out / "table.json").read_text())["rows"][0]
    config = load_config(str(out / "best.toml"))
    assert (config.mesh.data, config.mesh.model) == (best["data"], best["model"])
    assert config.model.remat == best["remat"] and config.model.sequence_parallel is True
    result = run_cli("local", "--pods", "1", "--devices-per-pod", "2", "--config", str(out / "best.toml"),
                     "--steps", "2", "--peak-flops", "1e10", "--set", "run.sample_tokens=0", "--set", "run.eval_batches=0",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1]
    # The metrics carry both utilisations; hardware FLOPs include what the pod really computes.
    assert records[-1]["mfu"] > 0 and records[-1]["hfu"] > 0
    assert records[-1]["hardware_flops_per_token"] > 0
    assert "compiled step:" in result.stdout


def test_memory_limit_drops_candidates_and_says_so(tmp_path):
    result = run_cli("tune", "--config", TINY, "--devices", "2", "--meshes", "2x1", "--microbatches", "1",
                     "--remat", "none", "--steps", "1", "--peak-flops", "1e10", "--memory-limit", "1KiB",
                     "--json", str(tmp_path / "t.json"), "--out", str(tmp_path / "best.toml"))
    assert result.returncode == 1, result.stdout + result.stderr
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["status"] == "over memory limit" and row["memory_bytes"] > 1024
    assert row.get("step_time_s") is None  # not timed
    assert "no candidate ran within the limits" in result.stdout
    assert not (tmp_path / "best.toml").exists()


def test_a_hung_candidate_is_reported_by_its_deadline(tmp_path):
    result = run_cli("tune", "--config", TINY, "--devices", "2", "--meshes", "2x1", "--microbatches", "1",
                     "--remat", "none", "--peak-flops", "1e10", "--candidate-timeout", "0.5",
                     "--json", str(tmp_path / "t.json"), "--out", str(tmp_path / "best.toml"), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["status"] == "error" and "timed out" in row["error"] and "0.5s" in row["error"]


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


def test_written_toml_round_trips(tmp_path):
    config = load_config(TINY, ["model.remat=\"selective\"", "mesh.model=2"])
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, sample_prompt='say "hi"\n\tend'))
    path = tmp_path / "c.toml"
    path.write_text(config_toml(config, ["a header"]))
    assert load_config(str(path)) == config


@pytest.mark.parametrize("text, value", [("1000", 1000), ("2KiB", 2048), ("1.5GiB", 3 * 2**29), ("3MB", 3_000_000)])
def test_memory_limit_sizes(text, value):
    assert parse_bytes(text) == value


def test_bad_tune_arguments_are_named():
    result = run_cli("tune", "--config", TINY, "--remat", "some")
    assert result.returncode == 2 and "remat policies are none, full, selective" in result.stderr
    result = run_cli("tune", "--config", TINY, "--memory-limit", "lots")
    assert result.returncode == 2 and "not a size: 'lots'" in result.stderr
