"""`multipod tune`'s report: ranking, MFU/HFU from the one utilisation function, the JSON report,
and the written config (tomli_w) loading back."""
import dataclasses
import json

import pytest

from multipod.controller.core.run_config import load_config
from multipod.controller.observe.metrics import mfu
from multipod.controller.tune.grid import Candidate
from multipod.controller.tune.table import best_row, config_toml, rank, write_config, write_report
from tests.helpers import TINY

CANDIDATES = [Candidate(2, 1, False, 1, "none"), Candidate(1, 2, True, 1, "full"),
              Candidate(1, 2, True, 3, "none"), Candidate(2, 1, False, 2, "none")]
RESULTS = [
    {"status": "ok", "step_time_s": 0.2, "memory_bytes": 4096, "hardware_flops_per_step": 3e9},
    {"status": "ok", "step_time_s": 0.1, "memory_bytes": 2048, "hardware_flops_per_step": 4e9},
    {"status": "error", "error": "ConfigError: model.microbatches: 3 does not divide the pod's batch"},
    {"status": "over memory limit", "memory_bytes": 10**9, "hardware_flops_per_step": 3e9},
]


def test_rank_orders_ran_then_over_limit_then_errors_and_computes_utilisation():
    flops_per_token, tokens_per_step, peak, devices = 1e5, 256, 1e10, 2
    table = rank(CANDIDATES, RESULTS, flops_per_token, tokens_per_step, peak, devices)
    assert [r["status"] for r in table] == ["ok", "ok", "over memory limit", "error"]
    assert [r["rank"] for r in table] == [1, 2, None, None]
    assert [r["mesh"] for r in table[:2]] == ["1x2", "2x1"]  # fastest first
    fast = table[0]
    assert fast["tokens_per_s"] == pytest.approx(2560)
    assert fast["model_flops_per_step"] == pytest.approx(flops_per_token * tokens_per_step)
    assert fast["mfu"] == pytest.approx(mfu(2560, flops_per_token, peak, devices))
    assert fast["mfu"] == pytest.approx(2560 * 1e5 / (1e10 * 2))
    # HFU: the same function with the hardware FLOPs per token (recomputation included).
    assert fast["hfu"] == pytest.approx(mfu(2560, 4e9 / tokens_per_step, peak, devices))
    assert fast["hfu"] == pytest.approx(4e9 / 0.1 / (1e10 * 2))
    for row in table[2:]:  # not timed: no throughput, no utilisation
        assert row["tokens_per_s"] is None and row["mfu"] is None and row["hfu"] is None
    assert table[3]["error"].startswith("ConfigError: model.microbatches: 3")
    assert table[0]["error"] is None
    assert best_row(table) is table[0]


def test_without_a_peak_utilisation_is_unknown():
    table = rank(CANDIDATES[:1], RESULTS[:1], 1e5, 256, None, 2)
    assert table[0]["tokens_per_s"] > 0 and table[0]["mfu"] is None and table[0]["hfu"] is None


def test_no_row_that_ran_means_no_best():
    table = rank(CANDIDATES[2:], RESULTS[2:], 1e5, 256, 1e10, 2)
    assert best_row(table) is None and all(r["rank"] is None for r in table)


def test_json_report_names_the_best_rank(tmp_path):
    table = rank(CANDIDATES, RESULTS, 1e5, 256, 1e10, 2)
    write_report(tmp_path / "t.json", table, devices=2, note="n")
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["best"] == 1 and report["devices"] == 2 and report["note"] == "n"
    assert [r["status"] for r in report["rows"]] == ["ok", "ok", "over memory limit", "error"]


def test_written_toml_round_trips(tmp_path):
    config = load_config(TINY, ["model.remat=\"selective\"", "mesh.model=2"])
    config = dataclasses.replace(config, sample=dataclasses.replace(config.sample, prompt='say "hi"\n\tend'))
    path = tmp_path / "c.toml"
    path.write_text(config_toml(config, ["a header"]))
    assert load_config(str(path)) == config


def test_write_config_keeps_the_header_and_loads_back(tmp_path):
    config = load_config(TINY, ["model.sequence_parallel=true", "mesh.model=2", "model.microbatches=2"])
    path = tmp_path / "best.toml"
    write_config(path, config, ["written by a test", "two\nlines"])
    text = path.read_text()
    assert text.startswith("# written by a test\n# two\n# lines\n")
    assert load_config(str(path)) == config
    # Every section and key is written, not only the ones that differ from the defaults.
    for section, values in config.to_dict().items():
        assert f"[{section}]" in text
        for key in values:
            assert f"\n{key} = " in text
