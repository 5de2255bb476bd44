"""End to end: `multipod local` with 3 and 4 pods (reduce-scatter + all-gather), compressed,
slow-link and encrypted transport, tiny model. The pods must stay bitwise identical every step."""
import pytest

from multipod.controller.core.run_config import load_config
from tests.helpers import TINY, run_param_count, train_identical_pods

STEPS = 4


def _run(tmp_path, pods: int, *settings: str):
    return train_identical_pods(tmp_path, pods, STEPS, settings=settings)


def test_three_pods_on_a_slow_encrypted_bf16_link_stay_identical(tmp_path):
    # dcn.encrypt: `multipod local` starts the workers with --dcn-encrypt (CURVE, keys from the token).
    records = _run(tmp_path, 3, "data.global_batch=6", "dcn.link_gbps=1.0", "dcn.link_latency_ms=1.0",
                   "dcn.encrypt=true", "dcn.compression=\"bf16\"")
    assert "data plane on curve://127.0.0.1:" in (tmp_path / "worker-0.log").read_text()
    params = run_param_count(tmp_path)
    for r in records:
        # Reduce-scatter + all-gather: each pod sends 2 (N - 1) / N of its gradient, 2 bytes a value.
        assert r["dcn_bytes_sent"] == 2 * 2 * params * 2
        for pod in r["pods"]:
            assert pod["idle_s"] >= 0.0
            assert pod["dcn_bytes_sent"] > 0


def test_four_pods_with_int8_transport_stay_identical(tmp_path):
    records = _run(tmp_path, 4, "data.global_batch=8", "dcn.compression=\"int8\"", "dcn.streams=2")
    params = run_param_count(tmp_path)
    for r in records:
        # One byte per value on the wire, plus one float32 scale per block of <= 256 values.
        assert 2 * 3 * params * (1 + 4 / 256) <= r["dcn_bytes_sent"] <= 2 * 3 * params * (1 + 4 / 256) * 1.02
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize("setting,message", [
    ("dcn.compression=\"fp8\"", "dcn.compression"),
    ("dcn.streams=0", "dcn.streams"),
    ("dcn.link_gbps=-1", "dcn.link_gbps"),
    ("dcn.lossless=\"fast\"", "dcn.lossless"),
])
def test_bad_dcn_settings_are_refused_by_name(setting, message):
    from multipod.controller.core.run_config import ConfigError
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [setting])
