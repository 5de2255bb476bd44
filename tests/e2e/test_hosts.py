"""End to end: pods of several hosts under `multipod local --hosts-per-pod 2` (four worker
processes for two pods; the two hosts of a pod form one jax.distributed cluster).

Compared with the same config on single-host pods of two devices: the per-step losses agree to
1e-5 (the programs are cut differently, so not bitwise), the pods are bitwise identical at every
step in both layouts, and each host moves half of the pod's gradient over the DCN."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from multipod.pod_worker import checkpoint
from tests.e2e.pod_failure import kill_and_finish
from tests.e2e.test_recovery import _events, _Live, _run
from tests.helpers import TINY, read_metrics, run_cli, run_param_count, same_losses

STEPS = 8
COMMON = ("--config", TINY, "--steps", str(STEPS), "--checkpoint-every", "4",
          "--set", "sample.tokens=0", "--set", "eval.batches=0", "--set", "dcn.timeout_s=30",
          "--set", "run.step_timeout_s=90", "--set", "health.interval_s=0.5", "--set", "health.timeout_s=3")
TWO_HOSTS = ("--pods", "2", "--hosts-per-pod", "2", "--devices-per-host", "1")
ONE_HOST = ("--pods", "2", "--devices-per-pod", "2")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("two-hosts")
    result = _run("local", *TWO_HOSTS, *COMMON, "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def _identical(records: list[dict]) -> None:
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert len(r["checksums"]) == 2 and len(set(r["checksums"])) == 1, r["step"]
    assert len({r["checksums"][0] for r in records}) == STEPS


def test_two_hosts_per_pod_train_like_one_host_with_both_devices(two_hosts, tmp_path, env):
    result = _run("local", *ONE_HOST, *COMMON, "--run-dir", str(tmp_path), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    hosts, single = read_metrics(two_hosts), read_metrics(tmp_path)
    _identical(hosts)
    _identical(single)
    same_losses(hosts, single)
    assert sorted(p.name for p in two_hosts.glob("worker-*.log")) == [
        "worker-0-host-0.log", "worker-0-host-1.log", "worker-1-host-0.log", "worker-1-host-1.log"]


def test_each_host_moves_half_of_the_pod_s_gradient(two_hosts):
    params = run_param_count(two_hosts)
    for r in read_metrics(two_hosts):
        for pod in r["pods"]:
            # 2 pods: each host sends its block (half of every leaf, rounded up) to its peer host.
            assert params * 4 / 2 <= pod["dcn_bytes_sent"] <= params * 4 / 2 + 64, r["step"]


def test_a_checkpoint_of_two_host_pods_restores_bitwise_onto_two_host_pods(two_hosts, tmp_path, env):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(two_hosts / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / str(STEPS))         # as if the run had stopped after step 4's checkpoint
    run_dir = tmp_path / "run"
    result = _run("local", *TWO_HOSTS, *COMMON, "--resume", "--checkpoint-dir", str(checkpoints),
                  "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from" in result.stdout and "step 4" in result.stdout
    resumed, original = read_metrics(run_dir), {r["step"]: r for r in read_metrics(two_hosts)}
    assert [r["step"] for r in resumed] == list(range(4, STEPS))
    for r in resumed:
        assert r["loss"] == original[r["step"]]["loss"] and r["checksums"] == original[r["step"]]["checksums"]


def test_a_checkpoint_of_two_host_pods_restores_onto_single_host_pods_of_two_devices(two_hosts, tmp_path, env):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(two_hosts / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / str(STEPS))
    saved = checkpoint.read_metadata(str(checkpoints / "4"))
    for host in (0, 1):     # each host of the pod wrote its part (orbax keeps one folder per process)
        assert any(f.is_file() for f in (checkpoints / "4" / "state" / f"ocdbt.process_{host}").rglob("*")), host
    run_dir = tmp_path / "run"
    result = _run("local", *ONE_HOST, *COMMON, "--resume", "--checkpoint-dir", str(checkpoints),
                  "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    restored = [e for e in _events(run_dir) if e["event"] == "restored"]
    # Each host wrote its shards; one process of two devices read them back bitwise.
    assert [(e["step"], e["fingerprint"]) for e in restored] == [(4, saved["fingerprint"])]
    resumed, original = read_metrics(run_dir), {r["step"]: r for r in read_metrics(two_hosts)}
    assert [r["step"] for r in resumed] == list(range(4, STEPS))
    for r in resumed:
        assert len(set(r["checksums"])) == 1, r["step"]
        assert r["loss"] == pytest.approx(original[r["step"]]["loss"], rel=1e-5), r["step"]


def test_a_killed_host_fails_its_pod_and_the_run_ends_as_if_uninterrupted(two_hosts, tmp_path, env):
    # Long enough for the kill at step 10, not for the pod's two hosts to restart, configure and
    # rejoin: from step steps - 3 the controller waits for the pod to be ready to rejoin (a test
    # hook, controller/core/fault_hooks.py), so its return is an event the run waits for.
    steps = 60
    args = [{str(STEPS): str(steps), "4": "50"}.get(a, a) for a in COMMON]
    # The uninterrupted reference runs meanwhile (side by side: the test takes the longer of the
    # two, not their sum; the survivor only trains slower, which leaves the pod more time to rejoin).
    reference = tmp_path / "reference"
    uninterrupted = _Live("local", *TWO_HOSTS, *args, "--run-dir", str(reference), env=env)
    run_dir = tmp_path / "run"
    run = _Live("local", *TWO_HOSTS, *args, "--run-dir", str(run_dir),
                env=dict(env, MULTIPOD_TEST_REJOIN_BY_STEP=str(steps - 3)))

    def host_1_of_pod_1() -> int:
        log = (run_dir / "worker-1-host-1.log").read_text()
        return int(re.findall(r"\(pid (\d+)\)", log)[-1])

    try:
        code = kill_and_finish(run, run_dir, host_1_of_pod_1, "degraded: 1/2 pods")
        assert code == 0, "".join(run.out) + "".join(run.err)
        assert uninterrupted.finish(400) == 0, "".join(uninterrupted.out) + "".join(uninterrupted.err)
    finally:
        if uninterrupted.proc.poll() is None:
            uninterrupted.proc.kill()
    records, expected = read_metrics(run_dir), {r["step"]: r for r in read_metrics(reference)}
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert set(r["checksums"]) == set(expected[r["step"]]["checksums"]), r["step"]
    assert json.loads((run_dir / "summary.json").read_text())["checksum"] == \
        json.loads((reference / "summary.json").read_text())["checksum"]
    events = _events(run_dir)
    assert [e["pods"] for e in events if e["event"] == "pod_failure"] == [[1]]
    assert [e["pods"] for e in events if e["event"] == "rejoin"] == [[1]]     # both hosts came back as one pod


def test_a_host_index_out_of_range_is_refused_naming_the_host():
    result = run_cli("worker", "--pod-index", "1", "--host-index", "2", "--hosts-per-pod", "2",
                     "--pod-coordinator", "127.0.0.1:1", "--insecure-no-auth", timeout=60)
    assert result.returncode != 0
    assert "pod 1 host 2" in result.stderr and "--host-index 2 is out of range" in result.stderr


def test_several_hosts_need_a_coordinator():
    result = run_cli("worker", "--pod-index", "0", "--host-index", "0", "--hosts-per-pod", "2",
                     "--insecure-no-auth", timeout=60)
    assert result.returncode != 0 and "--pod-coordinator must be HOST:PORT" in result.stderr
