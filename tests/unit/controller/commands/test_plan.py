"""`multipod plan` (controller/commands/plan.py): good input from flags, a run config and a --from
file; bad input (a non-positive bandwidth, a missing field, an unknown key) refused with exit code
2 and an error naming the flag or the [plan] key; the two published checks' input files."""
import json

import pytest

from multipod.cli import build_parser
from multipod.controller.commands import run
from multipod.model.config import ModelConfig
from tests.helpers import ROOT, run_cli

CLUSTER = ["--pods", "2", "--hosts-per-pod", "1", "--chips-per-pod", "8", "--peak-tflops", "100", "--mfu", "0.5",
           "--ici-gbps", "1000", "--dcn-gbps", "1", "--dcn-latency-ms", "0.5"]


def plan(*argv, capsys) -> tuple[int, str, str]:
    """`multipod plan ARGV` in this process: (exit code, stdout, stderr)."""
    code = run(build_parser().parse_args(["plan", *argv]))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_cli_prints_one_json_object_with_every_candidate_and_a_recommendation():
    result = run_cli("plan", "--params", "1.5B", "--tokens-per-step", "1M", *CLUSTER, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["inputs"]["model"]["params"] == 1_500_000_000
    assert report["inputs"]["layout"]["tokens_per_step"] == 1_000_000
    labels = [c["label"] for c in report["candidates"]]
    assert {"every step, fused, none", "every step, overlapped, none"} <= set(labels)
    assert any(label.startswith("DiLoCo") for label in labels)
    tiers = [c["tier"] for c in report["candidates"]]
    assert tiers == sorted(tiers)                      # the exact tier first
    best = report["recommended"]
    assert best["tier"] == "exact"                     # no --allow-lossy
    assert best["settings"]["sync"] == {"mode": "every_step"}
    for key in ("step_s", "exposed_comm_s", "weak_scaling", "dcn_bytes_per_step"):
        assert best[key] > 0
    # 1.5B float32 values, whole, each way between 2 pods.
    assert best["dcn_bytes_per_step"] == pytest.approx(6e9)


def test_allow_lossy_lets_a_slow_link_pick_a_math_changing_candidate(capsys):
    code, out, _ = plan("--params", "1.5B", "--tokens-per-step", "1M", *CLUSTER, "--allow-lossy", "--json",
                        capsys=capsys)
    assert code == 0
    best = json.loads(out)["recommended"]
    assert best["tier"] == "lossy" and best["settings"]["sync"]["mode"] == "diloco"


def test_a_run_config_gives_the_model_and_the_tokens_per_step(capsys):
    code, out, _ = plan("--config", str(ROOT / "configs" / "bench.toml"), *CLUSTER, "--json", capsys=capsys)
    assert code == 0
    report = json.loads(out)
    model = ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=1, head_dim=32, mlp_dim=1024)
    assert report["inputs"]["model"]["params"] == model.param_count()
    assert report["inputs"]["model"]["flops_per_token"] == model.flops_per_token(128)
    assert report["inputs"]["layout"]["tokens_per_step"] == 16 * 128      # data.global_batch x data.seq_len


def test_the_table_shows_the_candidates_and_the_recommended_settings_as_toml(capsys):
    code, out, _ = plan("--params", "100M", "--batch", "64", "--seq-len", "1024", *CLUSTER, capsys=capsys)
    assert code == 0
    assert "every step, overlapped, none" in out and "weak scaling" in out
    assert "[dcn]" in out and "[sync]" in out and 'mode = "every_step"' in out
    assert "--set sync.mode=" in out


@pytest.mark.parametrize("flag, value, message", [
    ("--dcn-gbps", "0", "--dcn-gbps: must be > 0"),
    ("--dcn-gbps", "-1", "--dcn-gbps: must be > 0"),
    ("--ici-gbps", "0", "--ici-gbps: must be > 0"),
    ("--peak-tflops", "0", "--peak-tflops: must be > 0"),
    ("--mfu", "46.2", "--mfu: is a fraction"),
    ("--chips-per-pod", "7", "--chips-per-pod"),
])
def test_a_bad_value_is_refused_naming_its_flag(flag, value, message, capsys):
    argv = list(CLUSTER)
    argv[argv.index(flag) + 1] = value
    code, _, err = plan("--params", "1B", "--tokens-per-step", "1M", *argv, "--hosts-per-pod", "2", capsys=capsys)
    assert code == 2
    assert f"error: config: {message}" in err


@pytest.mark.parametrize("extra, message", [
    # --layers 0 was divided by before it was checked: a ZeroDivisionError traceback.
    (("--layers", "0"), "--layers: must be a positive integer, got 0"),
    (("--model-parallel", "3"), "--model-parallel: a model axis of 3 does not divide the pod's 8 chips"),
])
def test_a_model_that_cannot_be_laid_out_is_refused_naming_its_flag(extra, message, capsys):
    code, _, err = plan("--params", "1B", "--tokens-per-step", "1M", *CLUSTER, *extra, capsys=capsys)
    assert code == 2
    assert f"error: config: {message}" in err


def test_a_missing_input_is_refused_naming_it(capsys):
    without_dcn = [a for i, a in enumerate(CLUSTER) if "--dcn-gbps" not in CLUSTER[max(0, i - 1):i + 1]]
    code, _, err = plan("--params", "1B", "--tokens-per-step", "1M", *without_dcn, capsys=capsys)
    assert code == 2 and "--dcn-gbps: missing" in err
    code, _, err = plan("--tokens-per-step", "1M", *CLUSTER, capsys=capsys)
    assert code == 2 and "--params: missing: give --config FILE or --params N" in err
    code, _, err = plan("--params", "1B", *CLUSTER, capsys=capsys)
    assert code == 2 and "--tokens-per-step: missing" in err


def test_a_from_file_gives_every_input_and_names_a_missing_or_unknown_key(tmp_path, capsys):
    good = tmp_path / "plan.toml"
    good.write_text("[plan]\nparams = 2e9\ntokens_per_step = \"1M\"\npods = 4\nhosts_per_pod = 1\n"
                    "chips_per_pod = 8\npeak_tflops = 100\nmfu = 0.5\nici_gbps = 1000\ndcn_gbps = 100\n"
                    "dcn_latency_ms = 0.1\n\n[calibration]\njitter_cv = 0.02\n")
    code, out, _ = plan("--from", str(good), "--json", capsys=capsys)
    assert code == 0
    report = json.loads(out)
    assert report["inputs"]["layout"]["pods"] == 4 and report["calibration"]["jitter_cv"] == 0.02
    assert (report["inputs"]["model"]["params"], report["inputs"]["layout"]["tokens_per_step"]) == (2e9, 1e6)
    assert report["recommended"]["dcn_bytes_per_step"] == pytest.approx(2e9 * 4 * 1.5)     # 2(N-1)/N, N = 4
    code, out, _ = plan("--from", str(good), "--pods", "2", "--json", capsys=capsys)          # a flag overrides
    assert code == 0 and json.loads(out)["inputs"]["layout"]["pods"] == 2

    missing = tmp_path / "missing.toml"
    missing.write_text(good.read_text().replace("dcn_gbps = 100\n", ""))
    code, _, err = plan("--from", str(missing), capsys=capsys)
    assert code == 2 and f"plan.dcn_gbps: missing from [plan] in {missing} (or give --dcn-gbps)" in err
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace("dcn_gbps = 100", "dcn_gbps = 0"))
    code, _, err = plan("--from", str(bad), capsys=capsys)
    assert code == 2 and "plan.dcn_gbps: must be > 0" in err
    typo = tmp_path / "typo.toml"
    typo.write_text(good.read_text().replace("dcn_gbps", "dcn_gpbs"))
    code, _, err = plan("--from", str(typo), capsys=capsys)
    assert code == 2 and "plan.dcn_gpbs: unknown key" in err
    code, _, err = plan("--from", str(tmp_path / "none.toml"), capsys=capsys)
    assert code == 2 and "--from: no such file" in err
    odd = tmp_path / "odd.toml"
    odd.write_text(good.read_text().replace("jitter_cv = 0.02", "jitter_cv = -1"))
    code, _, err = plan("--from", str(odd), capsys=capsys)
    assert code == 2 and "calibration.jitter_cv: must be >= 0" in err


@pytest.mark.parametrize("name, extra, fused, overlapped", [
    # docs/usage.md "Planning a cluster on paper" records these beside the published figures.
    ("palm540b_2x_v4.toml", [], 0.987, 0.994),
    ("maxtext32b_v5e.toml", [], 0.986, 0.993),
    ("maxtext32b_v5e.toml", ["--pods", "32", "--tokens-per-step", "67108864"], 0.974, 0.993),
])
def test_the_published_checks_project_what_the_docs_record(name, extra, fused, overlapped, capsys):
    code, out, _ = plan("--from", str(ROOT / "configs" / "plan" / name), *extra, "--json", capsys=capsys)
    assert code == 0
    rows = {c["label"]: c for c in json.loads(out)["candidates"]}
    assert rows["every step, fused, none"]["weak_scaling"] == pytest.approx(fused, abs=5e-4)
    assert rows["every step, overlapped, none"]["weak_scaling"] == pytest.approx(overlapped, abs=5e-4)
