"""End to end (issue 21, item 2): a killed pod's shard is split by microbatch over every survivor.

`multipod local`, 3 pods of configs/tiny.toml with model.microbatches = 2 (= N - 1): pod 1 is killed
with SIGKILL mid-run; while it is out, slot 1's two microbatches are computed one by each survivor
(pod 2 passes its partial sum on to pod 0, which ends it), and the run finishes with the
uninterrupted run's final checksum and every step's loss, each step recorded once. The same on
pods of two hosts, where host h of each pod relays its block of the partial sum to host h of the
next, which gathers the blocks over its hosts."""
from __future__ import annotations

import json
import re

from tests.e2e.pod_failure import held_env, kill_and_finish
from tests.e2e.test_recovery import _current_pid, _events, _Live, _run
from tests.helpers import TINY, read_metrics

STEPS = 24
KILL_AT = 5


def _args(*extra: str) -> tuple[str, ...]:
    return ("--pods", "3", "--devices-per-pod", "1", "--config", TINY, "--steps", str(STEPS), "--no-report",
            "--set", "sample.tokens=0", "--set", "eval.batches=0", "--set", "data.global_batch=6",
            "--set", "model.microbatches=2", "--set", "dcn.timeout_s=30", "--set", "run.step_timeout_s=90",
            "--set", "health.interval_s=0.5", "--set", "health.timeout_s=2", *extra)


def test_a_killed_pod_s_microbatches_are_spread_over_the_survivors(tmp_path, env):
    reference = tmp_path / "reference"
    result = _run("local", *_args(), "--run-dir", str(reference), env=env)
    assert result.returncode == 0, result.stdout + result.stderr

    run_dir = tmp_path / "killed"
    hold = tmp_path / "hold"
    run = _Live("local", *_args(), "--run-dir", str(run_dir), env=held_env(env, hold, KILL_AT + 1))
    code = kill_and_finish(run, run_dir, lambda: _current_pid(run_dir, 1)[0], "degraded: 2/3 pods", step=KILL_AT,
                           hold=hold)
    assert code == 0, "".join(run.out) + "".join(run.err)

    records, expected = read_metrics(run_dir), {r["step"]: r for r in read_metrics(reference)}
    assert [r["step"] for r in records] == list(range(STEPS)), "a step was lost or run twice"
    for r in records:
        assert set(r["checksums"]) == set(expected[r["step"]]["checksums"]), r["step"]
        if not r.get("partial_loss"):
            # The slot's loss travels with its partial sum: bitwise the healthy run's.
            assert r["loss"] == expected[r["step"]]["loss"], r["step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checksum"] == json.loads((reference / "summary.json").read_text())["checksum"]
    assert summary["lost_steps"] == 0
    assert [e for e in _events(run_dir) if e["event"] == "degraded"][0]["hosts"] == [0, 0, 2]

    degraded = [r for r in records if r["hosts"] == [0, 0, 2] and r["live_pods"] == 2]
    assert degraded, "no degraded step"
    for r in degraded:
        sent = {p["pod"]: p["dcn_bytes_sent"] for p in r["pods"]}
        # Whole-shard degraded mode: pod 0 sends slots 0 and 1, pod 2 only slot 2 (half as much).
        # Split: pod 2 also sends its partial sum of slot 1, so both send about two gradients.
        assert sent[2] > 0.9 * sent[0], (r["step"], sent)


# Pods of 2 hosts (one device each): 6 worker processes per run, so few steps.
HOST_STEPS = 6


def _host_args(*extra: str) -> tuple[str, ...]:
    return ("--pods", "3", "--hosts-per-pod", "2", "--devices-per-host", "1", "--config", TINY,
            "--steps", str(HOST_STEPS), "--no-report", "--set", "sample.tokens=0", "--set", "eval.batches=0",
            "--set", "data.global_batch=12", "--set", "model.microbatches=2", "--set", "dcn.timeout_s=30",
            "--set", "run.step_timeout_s=90", "--set", "health.interval_s=0.5", "--set", "health.timeout_s=3",
            *extra)


def test_on_pods_of_two_hosts_a_killed_pod_s_microbatches_are_spread_host_by_host(tmp_path, env):
    reference = tmp_path / "reference"
    result = _run("local", *_host_args(), "--run-dir", str(reference), env=env)
    assert result.returncode == 0, result.stdout + result.stderr

    run_dir = tmp_path / "killed"
    hold = tmp_path / "hold"      # the kill lands before step 2 whatever the machine's speed
    run = _Live("local", *_host_args(), "--run-dir", str(run_dir), env=held_env(env, hold, 2))

    def host_1_of_pod_1() -> int:    # one host dies; its pod fails as a whole
        return int(re.findall(r"\(pid (\d+)\)", (run_dir / "worker-1-host-1.log").read_text())[-1])

    code = kill_and_finish(run, run_dir, host_1_of_pod_1, "degraded: 2/3 pods", step=1, hold=hold)
    assert code == 0, "".join(run.out) + "".join(run.err)

    records, expected = read_metrics(run_dir), {r["step"]: r for r in read_metrics(reference)}
    assert [r["step"] for r in records] == list(range(HOST_STEPS)), "a step was lost or run twice"
    for r in records:
        assert set(r["checksums"]) == set(expected[r["step"]]["checksums"]), r["step"]
        if not r.get("partial_loss"):
            assert r["loss"] == expected[r["step"]]["loss"], r["step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checksum"] == json.loads((reference / "summary.json").read_text())["checksum"]
    assert summary["lost_steps"] == 0

    degraded = [r for r in records if r["hosts"] == [0, 0, 2] and r["live_pods"] == 2]
    assert degraded, "no degraded step"
    for r in degraded:
        # Split: pod 2 sends its partial sum of slot 1 as well as its own slot (see above).
        sent = {p["pod"]: p["dcn_bytes_sent"] for p in r["pods"]}
        assert sent[2] > 0.9 * sent[0], (r["step"], sent)
