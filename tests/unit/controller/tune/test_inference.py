"""`multipod tune --inference` in process: the (mesh x batch) grid and what it leaves out, the
ranking under --max-latency-ms, the table's errors, the runner with a stand-in probe, and the
command's outcome when no layout qualifies (the probes are faked: no jax is started)."""
import argparse
import dataclasses
import json
import sys

import pytest

from multipod.controller.commands.tune import add_arguments
from multipod.controller.core.run_config import ConfigError, load_config
from multipod.controller.tune import inference as tune_inference
from multipod.controller.tune.inference import (
    InferenceCandidate,
    best_row,
    candidate_payload,
    enumerate_candidates,
    print_table,
    rank,
    run_grid,
)
from tests.helpers import TINY

C = InferenceCandidate


def _model(**changes):
    return dataclasses.replace(load_config(TINY).model, **changes)


def test_grid_lists_meshes_that_do_not_divide_with_their_reason():
    # tiny: n_heads 4, mlp 64, vocab 2048; with 6 heads, model=4 no longer divides the heads.
    candidates, skipped = enumerate_candidates(_model(n_heads=6), devices=4, batches=[4])
    assert candidates == [C(4, 1, 4), C(2, 2, 4)]
    assert skipped == ["mesh 1x4: model=4 does not divide n_heads=6"]
    _, skipped = enumerate_candidates(_model(n_heads=6, mlp_dim=65), devices=4, batches=[4])
    assert skipped == ["mesh 2x2: model=2 does not divide mlp_dim=65",
                       "mesh 1x4: model=4 does not divide n_heads=6, mlp_dim=65"]


def test_grid_skips_batches_the_data_axis_does_not_divide():
    candidates, skipped = enumerate_candidates(_model(), devices=2)   # default batches 1, 2, 4, 8
    assert candidates == [C(2, 1, 2), C(2, 1, 4), C(2, 1, 8), C(1, 2, 1), C(1, 2, 2), C(1, 2, 4), C(1, 2, 8)]
    assert skipped == ["mesh 2x1 batch 1: data=2 does not divide the batch of 1"]
    candidates, skipped = enumerate_candidates(_model(), devices=4, meshes=[(4, 1)], batches=[2, 4, 6])
    assert candidates == [C(4, 1, 4)]
    assert skipped == ["mesh 4x1 batch 2: data=4 does not divide the batch of 2",
                       "mesh 4x1 batch 6: data=4 does not divide the batch of 6"]


def test_requested_meshes_are_tried_as_given():
    # An impossible mesh is not filtered: the probe reports it as that candidate's error.
    candidates, skipped = enumerate_candidates(_model(n_heads=6), devices=2, meshes=[(1, 4)], batches=[1])
    assert candidates == [C(1, 4, 1)] and skipped == []


def test_payload_is_the_pods_worker_config_with_the_mesh_and_the_batch():
    payload = candidate_payload(load_config(TINY), C(1, 2, 4))
    worker = json.loads(payload["worker"])
    assert payload["batch"] == 4 and worker["mesh"] == {"data": 1, "model": 2}
    assert worker["model"]["d_model"] == 32


def test_generate_takes_the_written_layout_and_its_own_flags_win(tmp_path):
    import argparse

    from multipod.controller.commands.generate_options import apply_layout
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.tune.inference import candidate_config
    from multipod.controller.tune.table import write_config
    path = tmp_path / "best.toml"
    write_config(path, candidate_config(load_config(TINY), C(1, 2, 4)), ["test"])
    args = argparse.Namespace(layout=str(path), devices=None, model_parallel=None, batch_size=None)
    apply_layout(args)
    assert (args.devices, args.model_parallel, args.batch_size) == (2, 2, 4)
    args = argparse.Namespace(layout=str(path), devices=4, model_parallel=None, batch_size=16)
    apply_layout(args)
    assert (args.devices, args.model_parallel, args.batch_size) == (4, 2, 16)
    args = argparse.Namespace(layout=None, devices=None, model_parallel=None, batch_size=None)
    apply_layout(args)
    assert (args.devices, args.model_parallel, args.batch_size) == (1, 1, 64)
    # Only [generate] is read: a corpus that does not exist here is no error.
    path.write_text(path.read_text().replace('path = ""', 'path = "/nowhere/corpus.jsonl"'))
    assert 'path = "/nowhere/corpus.jsonl"' in path.read_text()
    args = argparse.Namespace(layout=str(path), devices=None, model_parallel=None, batch_size=None)
    apply_layout(args)
    assert args.batch_size == 4
    path.write_text("[generate]\ndevices = 3\nmodel_parallel = 2\n")
    with pytest.raises(ConfigError, match="generate.model_parallel"):
        apply_layout(argparse.Namespace(layout=str(path), devices=None, model_parallel=None, batch_size=None))


CANDIDATES = [C(2, 1, 2), C(1, 2, 4), C(2, 1, 8), C(1, 2, 8), C(2, 2, 2), C(1, 2, 1)]
RESULTS = [
    # batch 2: 8 tokens in 10 ms -> 2 x 8 / 0.01 = 1,600 tokens/s
    {"status": "ok", "ttft_s": 0.002, "token_latency_s": 0.001, "generate_s": 0.01, "memory_bytes": 2**20},
    # batch 4: 3,200 tokens/s, 2 ms/token
    {"status": "ok", "ttft_s": 0.003, "token_latency_s": 0.002, "generate_s": 0.01, "memory_bytes": 2**20},
    # batch 8: 6,400 tokens/s but 5 ms/token
    {"status": "ok", "ttft_s": 0.004, "token_latency_s": 0.005, "generate_s": 0.01, "memory_bytes": 2**21},
    {"status": "over memory limit", "memory_bytes": 2**30},
    {"status": "error", "error": "ConfigError: mesh.data: data=2 x model=2 != the pod's 2 devices"},
    # batch 1: 800 tokens/s at 1 ms/token (the same latency as batch 2, less throughput)
    {"status": "ok", "ttft_s": 0.001, "token_latency_s": 0.001, "generate_s": 0.01, "memory_bytes": 2**20},
]


def test_rank_by_throughput_without_a_latency_limit():
    table = rank(CANDIDATES, RESULTS, tokens=8, max_latency_ms=None)
    assert [(r["mesh"], r["batch"]) for r in table] == [("2x1", 8), ("1x2", 4), ("2x1", 2), ("1x2", 1),
                                                        ("1x2", 8), ("2x2", 2)]
    assert [r["rank"] for r in table] == [1, 2, 3, 4, None, None]
    assert [r["tokens_per_s"] for r in table[:4]] == pytest.approx([6400, 3200, 1600, 800])
    assert table[0]["token_latency_ms"] == pytest.approx(5) and table[0]["ttft_ms"] == pytest.approx(4)
    assert best_row(table) is table[0]


def test_rows_over_the_latency_limit_are_marked_and_never_best():
    table = rank(CANDIDATES, RESULTS, tokens=8, max_latency_ms=2.0)
    assert [(r["batch"], r["status"]) for r in table] == [
        (4, "ok"), (2, "ok"), (1, "ok"), (8, "over latency limit"), (8, "over memory limit"), (2, "error")]
    assert [r["rank"] for r in table] == [1, 2, 3, None, None, None]
    over = table[3]
    assert over["tokens_per_s"] == pytest.approx(6400)   # measured and kept, just not eligible
    assert best_row(table)["batch"] == 4
    # The limit is inclusive; ties on throughput go to the lower latency.
    ties = rank([C(2, 1, 2), C(1, 2, 2)], [dict(RESULTS[0], token_latency_s=0.003), RESULTS[0]], 8, 3.0)
    assert [(r["mesh"], r["rank"]) for r in ties] == [("1x2", 1), ("2x1", 2)]


def test_nothing_within_the_limit_means_no_best():
    table = rank(CANDIDATES, RESULTS, tokens=8, max_latency_ms=0.5)
    assert best_row(table) is None and all(r["rank"] is None for r in table)
    assert sum(r["status"] == "over latency limit" for r in table) == 4


def test_table_rows_carry_their_errors(capsys):
    table = rank(CANDIDATES, RESULTS, tokens=8, max_latency_ms=2.0)
    error = next(r for r in table if r["status"] == "error")
    assert error["error"].startswith("ConfigError: mesh.data") and error["tokens_per_s"] is None
    assert all(r["error"] is None for r in table if r["status"] != "error")
    print_table(table, "title", max_latency_ms=2.0)
    printed = capsys.readouterr().out
    assert "error: ConfigError: mesh.data: data=2 x model=2 != the pod's 2 devices" in printed
    assert "over the latency limit (2 ms)" in printed and "over memory limit" in printed
    assert "6,400" in printed and "first token ms" in printed


# Speaks the inference probe's protocol; batch 3 makes it die, every other batch gets a result.
FAKE_PROBE = r"""
import json, os, sys
spec = json.loads(sys.stdin.readline())
print(json.dumps({"event": "ready", "device_kind": "fake", "num_devices": spec["devices"]}), flush=True)
for index, candidate in spec["candidates"]:
    print(json.dumps({"event": "start", "index": index}), flush=True)
    if candidate["batch"] == 3:
        print("probe exploded", file=sys.stderr, flush=True)
        os._exit(3)
    print(json.dumps({"event": "result", "index": index, "status": "ok", "ttft_s": 0.002, "token_latency_s": 0.001,
                      "generate_s": 0.01 * candidate["batch"], "memory_bytes": 2**20}), flush=True)
print(json.dumps({"event": "done"}), flush=True)
"""


def test_a_crashed_probe_is_that_candidates_error_and_the_search_goes_on():
    candidates = [C(1, 2, 1), C(1, 2, 3), C(1, 2, 2)]
    results, info = run_grid(load_config(TINY), candidates, devices=2, prompt_len=4, tokens=4, steps=1,
                             memory_limit=None, timeout_s=30, command=[sys.executable, "-c", FAKE_PROBE])
    assert [r["status"] for r in results] == ["ok", "error", "ok"]
    assert "the tuning process died (exit code 3)" in results[1]["error"] and "probe exploded" in results[1]["error"]
    assert info == {"device_kind": "fake", "num_devices": 2}
    table = rank(candidates, results, tokens=4, max_latency_ms=None)
    assert [r["status"] for r in table] == ["ok", "ok", "error"]


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--config", TINY, *argv])


def test_when_nothing_qualifies_the_command_says_so_and_writes_no_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune_inference, "run_grid", lambda config, candidates, *rest: (
        [RESULTS[0] for _ in candidates], {"device_kind": "fake"}))
    out = tmp_path / "best.toml"
    args = _args("--inference", "--batches", "2", "--tokens", "8", "--max-latency-ms", "0.5",
                 "--json", str(tmp_path / "t.json"), "--out", str(out))
    assert tune_inference.main(args) == 1
    printed = capsys.readouterr().out
    assert "no candidate is within --max-latency-ms 0.5: the lowest per-token latency measured was 1.00 ms" in printed
    assert "no config written" in printed and not out.exists()
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["best"] is None and report["max_latency_ms"] == 0.5
    assert {r["status"] for r in report["rows"]} == {"over latency limit"}
    # Within the limit: the best is written as a config that loads, its layout in [generate].
    args = _args("--inference", "--batches", "2", "--tokens", "8", "--max-latency-ms", "1", "--out", str(out))
    assert tune_inference.main(args) == 0
    config = load_config(str(out))
    assert (config.mesh.data, config.mesh.model) == (2, 1)
    assert (config.generate.devices, config.generate.model_parallel, config.generate.batch_size) == (2, 1, 2)


def test_options_of_the_other_mode_are_refused():
    with pytest.raises(ConfigError, match="--remat: applies to training layouts"):
        tune_inference.check_mode(_args("--inference", "--remat", "none"))
    with pytest.raises(ConfigError, match="--max-latency-ms: applies only with --inference"):
        tune_inference.check_mode(_args("--max-latency-ms", "3"))
    with pytest.raises(ConfigError, match=r"--prompt-len 16 \+ --tokens 32 = 48 exceed"):
        tune_inference.main(_args("--inference"))    # tiny's context is 32 tokens
