"""`multipod tune` end to end: the ranked table with errors, the memory limit, deadlines, and a
written config that trains. (The grid, the runner's protocol and the table's maths are unit-tested
in tests/unit/controller/tune/.)"""
import json

import pytest

from multipod.controller.core.run_config import load_config
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
        # The time is the trainer's own step (PodTrainer.train_step), with its parts.
        assert set(r["step_parts_s"]) == {"compute_s", "update_s", "checksum_s"}
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
    assert (out / "best.toml").read_text().startswith("# written by `multipod tune`")
    config = load_config(str(out / "best.toml"))
    assert (config.mesh.data, config.mesh.model) == (best["data"], best["model"])
    assert config.model.remat == best["remat"] and config.model.sequence_parallel is True
    result = run_cli("local", "--pods", "1", "--devices-per-pod", "2", "--config", str(out / "best.toml"),
                     "--steps", "2", "--peak-flops", "1e10", "--no-report", "--set", "sample.tokens=0",
                     "--set", "eval.batches=0", "--run-dir", str(tmp_path / "run"))
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


def test_bad_tune_arguments_are_named():
    result = run_cli("tune", "--config", TINY, "--remat", "some")
    assert result.returncode == 2 and "remat policies are none, full, selective" in result.stderr
    result = run_cli("tune", "--config", TINY, "--memory-limit", "lots")
    assert result.returncode == 2 and "not a size: 'lots'" in result.stderr
    result = run_cli("tune", "--config", TINY, "--candidate-timeout", "0")
    assert result.returncode == 2 and "--candidate-timeout: must be > 0 seconds" in result.stderr


def test_inference_ranks_generation_layouts_and_honours_the_latency_limit(tmp_path):
    # Every (mesh, batch) of 2 devices: 2x1 cannot split a batch of 1 (left out, said so).
    result = run_cli("tune", "--inference", "--config", TINY, "--devices", "2", "--batches", "1,2", "--tokens", "4",
                     "--steps", "1", "--json", str(tmp_path / "t.json"), "--out", str(tmp_path / "best.toml"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "t.json").read_text())
    rows = report["rows"]
    assert sorted((r["mesh"], r["batch"]) for r in rows) == [("1x2", 1), ("1x2", 2), ("2x1", 2)]
    assert "left out mesh 2x1 batch 1: data=2 does not divide the batch of 1" in result.stdout
    for r in rows:   # each row ran (its measurements) or carries its error
        if r["status"] == "ok":
            assert r["error"] is None and r["rank"] is not None
            assert r["ttft_ms"] > 0 and r["token_latency_ms"] > 0 and r["tokens_per_s"] > 0 and r["memory_bytes"] > 0
            assert len(r["token_latencies_s"]) == 3   # 4 tokens: the prefill's, then 3 decode steps
        else:
            assert r["status"] == "error" and r["error"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and rows[:len(ok)] == ok and report["best"] == 1
    assert [r["tokens_per_s"] for r in ok] == sorted((r["tokens_per_s"] for r in ok), reverse=True)
    assert "ms/token" in result.stdout and "tokens/s" in result.stdout
    config = load_config(str(tmp_path / "best.toml"))
    assert (config.mesh.data, config.mesh.model) == (ok[0]["data"], ok[0]["model"])
    layout = config.generate     # what `multipod generate --layout best.toml` takes
    assert (layout.devices, layout.model_parallel, layout.batch_size) == (2, ok[0]["model"], ok[0]["batch"])


def test_inference_with_no_layout_within_the_latency_limit_says_so(tmp_path):
    # No layout decodes a token in a microsecond: nothing qualifies, and the command says so (exit 1).
    result = run_cli("tune", "--inference", "--config", TINY, "--devices", "2", "--meshes", "2x1,2x2", "--batches",
                     "2", "--tokens", "4", "--steps", "1", "--max-latency-ms", "0.001",
                     "--json", str(tmp_path / "t2.json"), "--out", str(tmp_path / "none.toml"))
    assert result.returncode == 1, result.stdout + result.stderr
    over, failed = json.loads((tmp_path / "t2.json").read_text())["rows"]
    assert over["status"] == "over latency limit" and over["rank"] is None and over["token_latency_ms"] > 0.001
    assert failed["status"] == "error" and "data=2 x model=2 != the pod's 2 devices" in failed["error"]
    assert "no candidate is within --max-latency-ms 0.001" in result.stdout and "no config written" in result.stdout
    assert not (tmp_path / "none.toml").exists()
