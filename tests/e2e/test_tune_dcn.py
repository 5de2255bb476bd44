"""`multipod tune --dcn` end to end on a shaped link: two pods in network namespaces (links shaped
by tbf, TLS + CURVE), the link measured on their data plane, the compute by the layout probe, the
best candidates predicted and run, and the written config trains under `multipod local --config`.
Needs root (CI runs as root); skipped, saying why, only where namespaces cannot be made. The unit
tests of the candidates, ranking and choice are tests/unit/controller/tune/test_dcn_tuner.py."""
from __future__ import annotations

import json

import pytest

from multipod.controller.core.run_config import load_config
from tests.helpers import TINY, read_metrics, require_namespaces, run_cli

RATE_GBPS = 0.1


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    require_namespaces()
    out = tmp_path_factory.mktemp("tune-dcn")
    result = run_cli("tune", "--dcn", "--config", TINY, "--pods", "2", "--devices", "2", "--netns",
                     "--netns-rate-gbps", str(RATE_GBPS), "--steps", "2", "--probe-rounds", "2", "--streams", "1,2",
                     "--chunk-bytes", "1MiB", "--compressions", "none,int8", "--run-exact", "2", "--run-lossy", "1",
                     "--trial-steps", "6", "--warmup-steps", "2", "--json", str(out / "report.json"),
                     "--out", str(out / "tuned.toml"), timeout=600, cwd=out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text()), result


def test_the_shaped_link_is_measured_on_the_encrypted_data_plane(tuned):
    _, report, result = tuned
    link = report["link"]
    assert link["measured"] and link["encrypted"] is True
    # What CURVE costs, timed on each pod's host apart from the link: far above the shaped rate.
    encryption = link["encryption"]
    assert [h["pod"] for h in encryption["hosts"]] == [0, 1]
    assert all(h["curve_bytes_per_s"] > 0 and h["plain_bytes_per_s"] > 0 for h in encryption["hosts"])
    assert encryption["link_encrypted"] is True and encryption["bound"] is False
    assert "encryption: CURVE moves pod 0" in result.stdout and "costs nothing" in result.stdout
    assert {(v["streams"], v["chunk_bytes"]) for v in link["variants"]} == {(1, 1 << 20), (2, 1 << 20)}
    for variant in link["variants"]:      # the tbf rate, not loopback's (tens of Gb/s)
        assert 0.3 * RATE_GBPS < variant["gbps"] < 1.5 * RATE_GBPS, variant
    assert link["latency_ms"] > 0
    compute = report["compute"]
    # Each part was timed (their order is the machine's noise on a model this small: a forward pass
    # alone has measured slower than forward + backward); the derived parts are their clamped differences.
    assert all(compute[k] > 0 for k in ("step_s", "compute_s", "forward_s", "overlapped_step_s"))
    assert compute["backward_s"] == pytest.approx(max(compute["compute_s"] - compute["forward_s"], 0.0))
    assert compute["update_s"] == pytest.approx(max(compute["step_s"] - compute["compute_s"], 0.0))


def test_the_best_candidates_ran_predicted_against_measured_and_the_choice_is_exact(tuned):
    out, report, result = tuned
    trials = report["trials"]
    assert [t["tier"] for t in trials] == ["exact", "exact", "lossy"]
    for t in trials:
        assert t["error"] == "" and t["measured_step_s"] > 0 and t["predicted_step_s"] > 0
        assert t["prediction_error"] == pytest.approx((t["predicted_step_s"] - t["measured_step_s"])
                                                      / t["measured_step_s"])
    exact = [t["measured_step_s"] for t in trials if t["tier"] == "exact"]
    assert exact == sorted(exact)                    # ranked by what was measured
    assert trials[2]["loss_delta_vs_exact"] is not None
    chosen = report["chosen"]
    assert chosen["tier"] == "exact" and chosen["measured_step_s"] == min(exact)    # no --allow-lossy
    assert "prediction error: at most" in result.stdout
    config = load_config(str(out / "tuned.toml"))
    settings = chosen["settings"]
    assert config.dcn.streams == settings["dcn"]["streams"] and config.dcn.chunk_bytes == 1 << 20
    assert config.sync.mode.value == "every_step" and config.dcn.compression.value == "none"


def test_the_written_config_trains_on_the_shaped_link(tuned, tmp_path):
    out, report, _ = tuned
    run_dir = tmp_path / "run"
    result = run_cli("local", "--pods", "2", "--devices-per-pod", "2", "--netns", "--netns-rate-gbps", str(RATE_GBPS),
                     "--config", str(out / "tuned.toml"), "--steps", "3", "--no-peak", "--no-report",
                     "--set", "sample.tokens=0", "--set", "eval.batches=0", "--run-dir", str(run_dir), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    ran = json.loads((run_dir / "config.json").read_text())
    assert ran["dcn"]["streams"] == report["chosen"]["settings"]["dcn"]["streams"]
