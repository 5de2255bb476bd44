"""End to end under `multipod local`: runs that survive.

One uninterrupted reference run (with a NaN gradient injected at step 2 and a loss spike at
step 7, both test-only hooks on pod 0) is compared with
  * a run whose pod 1 is killed with SIGKILL mid-run (the supervisor restarts it, the controller
    restores every pod to the last checkpoint): same final fingerprint;
  * a run resumed from the reference run's checkpoints: same per-step losses, same fingerprint.
A last run has pod 1 stopped with SIGSTOP and must name it within the health deadline.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, TINY, cli_env, pid_alive, read_metrics, run_cli

STEPS = 10
COMMON = ("--pods", "2", "--devices-per-pod", "1", "--config", TINY, "--steps", str(STEPS),
          "--checkpoint-every", "3", "--on-spike", "rewind", "--skip-batches", "2",
          "--set", "run.sample_tokens=0", "--set", "run.eval_batches=0", "--set", "run.keep_checkpoints=3",
          "--set", "run.spike_window=3", "--set", "run.debug_poison_pod=0", "--set", "run.debug_nan_step=2",
          "--set", "run.debug_spike_step=7", "--set", "dcn.timeout_s=10", "--set", "run.step_timeout_s=60",
          "--set", "run.health_interval_s=1", "--set", "run.health_timeout_s=5")


def _final(run_dir: pathlib.Path) -> dict[int, dict]:
    """The last record of every step (a step replayed after a recovery appears twice)."""
    return {r["step"]: r for r in read_metrics(run_dir)}


def _events(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "controller.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT, stdin=subprocess.DEVNULL)


def _wait_for_step(proc: subprocess.Popen, run_dir: pathlib.Path, step: int, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(r["step"] >= step for r in read_metrics(run_dir) if r):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def _current_pid(run_dir: pathlib.Path, pod: int) -> tuple[int, int]:
    """(pid, port) of the latest incarnation of a local worker, from its log."""
    found = re.findall(r"serving on [\d.]+:(\d+) \(pid (\d+)\)", (run_dir / f"worker-{pod}.log").read_text())
    assert found, f"pod {pod} never served"
    return int(found[-1][1]), int(found[-1][0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    result = run_cli("local", *COMMON, "--run-dir", str(run_dir), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def test_nan_gradient_step_is_skipped_the_same_way_on_every_pod(reference):
    records = _final(reference)
    assert records[2]["skipped"] and not any(records[s]["skipped"] for s in records if s != 2)
    # Both pods skipped the update: identical fingerprints, and the state did not change.
    assert len(set(records[2]["fingerprints"])) == 1
    assert records[2]["fingerprints"] == records[1]["fingerprints"]
    assert records[3]["fingerprints"] != records[2]["fingerprints"]
    assert records[STEPS - 1]["skipped_steps"] == 1
    assert json.loads((reference / "summary.json").read_text())["skipped_steps"] == 1


def test_loss_spike_rewinds_to_the_checkpoint_before_it_and_skips_batches(reference):
    rewinds = [e for e in _events(reference) if e["event"] == "rewind"]
    assert len(rewinds) == 1
    assert rewinds[0]["spike_step"] == 7 and rewinds[0]["to_step"] == 6 and rewinds[0]["data_offset"] == 2
    records = _final(reference)
    assert sorted(records) == list(range(STEPS))
    # After the rewind, step s trains on batch s + 2; before it, on batch s.
    assert [records[s]["data_index"] for s in range(STEPS)] == list(range(6)) + [s + 2 for s in range(6, STEPS)]
    assert max(r["loss"] for r in records.values()) < 10      # the spiked loss was replaced
    for r in records.values():
        assert len(set(r["fingerprints"])) == 1


def test_checkpoints_are_written_and_only_the_last_k_kept(reference):
    saved = [e["step"] for e in _events(reference) if e["event"] == "checkpoint_saved"]
    assert saved == [0, 3, 6, 9, 10]
    assert sorted(int(p.name) for p in (reference / "checkpoints").iterdir() if p.name.isdigit()) == [6, 9, 10]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["last_checkpoint"] == str(reference / "checkpoints" / "10")


def test_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(reference, tmp_path):
    proc = _start("local", *COMMON, "--run-dir", str(tmp_path))
    try:
        _wait_for_step(proc, tmp_path, 3)
        pid, port = _current_pid(tmp_path, 1)
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "pod 1" in stdout and "recovered" in stdout
    new_pid, new_port = _current_pid(tmp_path, 1)
    assert new_pid != pid and new_port == port          # restarted on the same port
    failures = [e for e in _events(tmp_path) if e["event"] == "pod_failure"]
    assert failures and "pod 1" in failures[0]["error"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts"] == 1
    expected = json.loads((reference / "summary.json").read_text())["fingerprint"]
    assert summary["fingerprint"] == expected
    assert _final(tmp_path)[STEPS - 1]["loss"] == _final(reference)[STEPS - 1]["loss"]


def test_resumed_run_equals_the_uninterrupted_run(reference, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / "10")          # as if the run had stopped after step 9's checkpoint
    run_dir = tmp_path / "run"
    result = run_cli("local", *COMMON, "--resume", "--checkpoint-dir", str(checkpoints), "--run-dir", str(run_dir),
                     timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from" in result.stdout and "step 9" in result.stdout
    resumed, original = _final(run_dir), _final(reference)
    assert sorted(resumed) == [9]
    for step, record in resumed.items():     # bitwise: exact float equality
        assert record["loss"] == original[step]["loss"]
        assert record["fingerprints"] == original[step]["fingerprints"]
        assert record["data_index"] == original[step]["data_index"]
    assert json.loads((run_dir / "summary.json").read_text())["fingerprint"] == \
        json.loads((reference / "summary.json").read_text())["fingerprint"]


def test_hung_worker_is_reported_by_name_within_the_deadline(tmp_path):
    proc = _start("local", "--pods", "2", "--devices-per-pod", "1", "--config", TINY, "--steps", "500",
                  "--max-restarts", "0", "--set", "run.sample_tokens=0", "--set", "run.eval_batches=0",
                  "--set", "run.health_interval_s=0.5", "--set", "run.health_timeout_s=2",
                  "--set", "run.step_timeout_s=120", "--set", "dcn.timeout_s=120", "--run-dir", str(tmp_path))
    pid = None
    try:
        _wait_for_step(proc, tmp_path, 2)
        pid, port = _current_pid(tmp_path, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, stdout + stderr
    assert f"pod 1 (127.0.0.1:{port}) is not responding" in stderr
    assert "--max-restarts 0" in stderr and "last good checkpoint" in stderr
    # Far sooner than the 120 s step and DCN deadlines: the health watchdog found it (2 missed
    # checks of 2 s each, 0.5 s apart), with ample slack for a loaded machine.
    assert elapsed < 60, elapsed
    assert not pid_alive(pid)
