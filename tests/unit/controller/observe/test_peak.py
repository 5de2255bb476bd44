"""MFU by default (controller/observe/peak.py resolve_peak): the peak comes from --peak-flops, else the
cache, else one measurement on this machine (for local pods), cached for the next run."""
from __future__ import annotations

import dataclasses
import json

import pytest

from multipod.controller.core.run_config import RunConfig
from multipod.controller.observe import peak


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    monkeypatch.setenv("MULTIPOD_PEAK_FILE", str(path))
    return path


@pytest.fixture
def measured(monkeypatch):
    calls = []

    def fake_measure(devices, size=1024, repeats=7, timeout_s=600):
        calls.append(devices)
        return {"devices": devices, "device_kind": "cpu", "per_device_flops": 5e10}

    monkeypatch.setattr(peak, "measure", fake_measure)
    return calls


def test_the_first_local_run_measures_once_and_caches(cache, measured):
    run = RunConfig()
    assert peak.resolve_peak(run, "cpu", 4, local=True) == 5e10
    assert peak.resolve_peak(run, "cpu", 4, local=True) == 5e10     # from the cache now
    assert measured == [4]
    assert json.loads(cache.read_text())["cpu/4"]["per_device_flops"] == 5e10


def test_given_peak_no_peak_and_remote_pods_never_measure(cache, measured):
    assert peak.resolve_peak(RunConfig(peak_flops=1e9), "cpu", 2, local=True) == 1e9
    assert peak.resolve_peak(RunConfig(measure_peak=False), "cpu", 2, local=True) is None
    # Pods elsewhere: this machine's peak says nothing about theirs.
    assert peak.resolve_peak(RunConfig(), "cpu", 2, local=False) is None
    assert measured == []


def test_a_failed_measurement_leaves_mfu_unknown_and_the_run_going(cache, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("peak measurement failed: boom")

    monkeypatch.setattr(peak, "measure", broken)
    assert peak.resolve_peak(dataclasses.replace(RunConfig()), "cpu", 1, local=True) is None
    assert "MFU not reported" in capsys.readouterr().out and not cache.exists()
