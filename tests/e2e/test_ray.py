"""End to end: `multipod ray` against a real Ray cluster on this machine (one per module, started
here with ray.init and a few logical CPUs), on the tiny config.

Each run is checked for what the issue asks: the pods bitwise identical at every step, the same
final state checksum as `multipod local`, a killed actor restarted by Ray and rejoining without a
step run twice, nothing of the run left in the cluster afterwards (after the end and after
Ctrl-C), and clear errors for a missing cluster, a request the cluster cannot place and a
missing `ray` package."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import time

import pytest
import ray  # the test extra brings it (pyproject.toml): CI runs these tests

from tests.e2e.test_recovery import _Live, _wait_for_step
from tests.helpers import TINY, read_metrics, run_cli

CPUS = 4
# Tiny steps take ~10 ms: enough of them for a killed pod to come back and rejoin before the end.
KILL_STEPS = 2000


def _args(steps: int, *extra: str) -> tuple[str, ...]:
    return ("--config", TINY, "--steps", str(steps), "--no-report", "--set", "sample.tokens=0",
            "--set", "eval.batches=0", "--set", "data.global_batch=4", "--set", "dcn.timeout_s=30",
            "--set", "run.step_timeout_s=90", "--set", "health.interval_s=0.5", "--set", "health.timeout_s=2", *extra)


@pytest.fixture(scope="module")
def cluster(env):
    """A local Ray cluster of CPUS logical CPUs for the module; its GCS address. Ray's token
    authentication is off (it would write a token under ~/.ray): the address is local."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE",)}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        context = _start_local_ray()
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_local_ray(attempts: int = 2):
    """ray.init of a local cluster, tried again once if Ray's own start fails. On this loaded
    2-core machine Ray's raylet has once never registered with its GCS (Ray waits a fixed 30 s,
    then raises "The current node timed out during startup"; the session's logs held no raylet
    log at all). That is Ray starting, before any of multipod's code runs."""
    for attempt in range(attempts):
        try:
            return ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False,
                            configure_logging=False)
        except Exception as exc:    # Ray raises a bare Exception for this
            ray.shutdown()
            if attempt + 1 == attempts or "timed out during startup" not in str(exc):
                raise
            print(f"Ray's local cluster did not start ({exc}); starting it again")


@pytest.fixture(scope="module")
def ray_env(env, cluster) -> dict:
    return dict(env, RAY_AUTH_MODE="disabled")


def _ray(cluster: str, run_dir: pathlib.Path, steps: int, *extra: str, env: dict, timeout: float = 300):
    return run_cli("ray", "--address", cluster, "--pods", "2", "--devices-per-host", "1",
                   "--run-dir", str(run_dir), *_args(steps, *extra), env=env, timeout=timeout)


def _left_in_cluster() -> tuple[list, list]:
    """(actors, placement groups) of multipod runs that are not gone."""
    from ray.util import placement_group_table
    groups = [g for g in placement_group_table().values()
              if g["name"].startswith("multipod-") and g["state"] != "REMOVED"]
    actors = [name for name in ray.util.list_named_actors(all_namespaces=True)
              if name["name"].startswith("multipod-")]
    return actors, groups


def _wait_nothing_left(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _left_in_cluster() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left_in_cluster() == ([], []), _left_in_cluster()


def _checksum(run_dir: pathlib.Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["checksum"]


def _identical_every_step(run_dir: pathlib.Path, steps: int) -> list[dict]:
    """Every step recorded once, its live pods' checksums equal."""
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or run twice"
    for r in records:
        assert len(r["checksums"]) == r["live_pods"] and len(set(r["checksums"])) == 1, \
            f"pods differ at step {r['step']}"
    return records


def test_two_pods_train_on_ray_like_local_and_leave_nothing_behind(cluster, ray_env, tmp_path):
    steps = 8
    result = _ray(cluster, tmp_path / "ray", steps, env=ray_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started 2 pod(s) x 1 host(s) on Ray" in result.stdout
    assert all(r["live_pods"] == 2 for r in _identical_every_step(tmp_path / "ray", steps))
    for pod in (0, 1):      # each worker's log is in the run directory, as under `multipod local`
        log = (tmp_path / "ray" / f"worker-{pod}.log").read_text()
        assert f"pod {pod} serving on 127.0.0.1:" in log and "ray actor (pid" in log
    _wait_nothing_left()
    local = run_cli("local", "--pods", "2", "--devices-per-pod", "1", "--run-dir", str(tmp_path / "local"),
                    *_args(steps), env=ray_env)
    assert local.returncode == 0, local.stdout + local.stderr
    assert _checksum(tmp_path / "ray") == _checksum(tmp_path / "local")


def test_ctrl_c_tears_down_every_actor_and_placement_group(cluster, ray_env, tmp_path):
    run = _Live("ray", "--address", cluster, "--pods", "2", "--devices-per-host", "1", "--run-dir", str(tmp_path),
                *_args(100_000), env=ray_env)
    try:
        _wait_for_step(run.proc, tmp_path, 2, timeout=120)
        assert _left_in_cluster()[1], "the run's placement groups should exist while it trains"
        run.proc.send_signal(signal.SIGINT)
        # The launcher's own bounds add up to about 40 s (the monitor's join 15 s, the workers'
        # stop 15 s, then kills, placement groups and ray.shutdown); under a loaded machine a
        # 60 s wait was missed once. A hang is still caught.
        code = run.finish(120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert code == 130, "".join(run.out + run.err)
    assert "interrupted" in "".join(run.err)
    _wait_nothing_left()


def test_a_controller_error_after_the_pods_started_tears_them_down(cluster, ray_env, tmp_path):
    # A model axis of 2 on pods of 1 device: refused by the pods when they configure, after they started.
    result = _ray(cluster, tmp_path, 2, "--set", "mesh.model=2", env=ray_env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "started 2 pod(s)" in result.stdout and "mesh.model: 2 does not divide the pod's 1 devices" in result.stderr
    _wait_nothing_left()


def test_no_cluster_at_the_address_is_a_clear_error(tmp_path):
    import socket
    with socket.socket() as s:      # a port where nothing listens, held so that nothing else takes it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = run_cli("ray", "--address", f"127.0.0.1:{port}", "--run-dir", str(tmp_path), *_args(2),
                         timeout=120)
    assert result.returncode == 1
    assert f"no Ray cluster at --address 127.0.0.1:{port}" in result.stderr


def test_more_pods_than_the_cluster_can_place_is_a_clear_error(cluster, ray_env, tmp_path):
    # More CPUs than the cluster has: refused at once, naming the shortfall.
    result = run_cli("ray", "--address", cluster, "--pods", "8", "--devices-per-host", "1",
                     "--run-dir", str(tmp_path / "a"), *_args(2, "--set", "data.global_batch=8"), env=ray_env,
                     timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"8 CPU in all, and the cluster has {CPUS}" in result.stderr
    # Enough in all, but held by someone else: refused at the placement deadline.
    from ray.util.placement_group import placement_group, remove_placement_group
    hold = placement_group([{"CPU": CPUS - 1}])
    ray.get(hold.ready(), timeout=30)
    try:
        result = run_cli("ray", "--address", cluster, "--pods", "2", "--devices-per-host", "1",
                         "--place-timeout", "3", "--run-dir", str(tmp_path / "b"), *_args(2), env=ray_env,
                         timeout=120)
    finally:
        remove_placement_group(hold)
    assert result.returncode == 1, result.stdout + result.stderr
    # One CPU is free: one pod is placed, and only the other is named.
    assert re.search(r"Ray could not place pod\(s\) \[\d\] within 3s", result.stderr), result.stderr
    # STRICT_SPREAD over more hosts per pod than there are nodes, and the strategy that fits.
    result = run_cli("ray", "--address", cluster, "--pods", "1", "--hosts-per-pod", "2",
                     "--run-dir", str(tmp_path / "c"), *_args(2), env=ray_env, timeout=120)
    assert result.returncode == 1 and "--placement-strategy PACK" in result.stderr, result.stdout + result.stderr
    _wait_nothing_left()


def test_without_ray_installed_it_says_which_extra_to_install(tmp_path):
    fake = tmp_path / "site" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray (simulated)')\n")
    result = run_cli("ray", "--run-dir", str(tmp_path / "run"), *_args(2), env={"PYTHONPATH": str(fake.parent)})
    assert result.returncode == 1
    assert "multipod ray needs Ray" in result.stderr and "pip install 'multipod[ray]'" in result.stderr
    assert not (tmp_path / "run").exists()      # refused before anything was done


def _kill_actor_and_finish(run, run_dir, log) -> int:
    """At step 20, SIGKILL the actor process whose worker writes `log` (Ray restarts the actor);
    wait for the degraded run, the rejoin and the end; the run's exit code."""
    try:
        _wait_for_step(run.proc, run_dir, 20)
        os.kill(int(re.findall(r"ray actor \(pid (\d+)\)", log.read_text())[-1]), signal.SIGKILL)
        run.wait_for("degraded: 1/2 pods", 120)
        run.wait_for("rejoined", 300)
        return run.finish(600)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()


@pytest.mark.slow
def test_a_killed_actor_is_restarted_by_ray_and_the_run_ends_as_if_uninterrupted(cluster, ray_env, tmp_path):
    reference = run_cli("local", "--pods", "2", "--devices-per-pod", "1", "--run-dir", str(tmp_path / "ref"),
                        *_args(KILL_STEPS), env=ray_env, timeout=600)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    run_dir = tmp_path / "ray"
    run = _Live("ray", "--address", cluster, "--pods", "2", "--devices-per-host", "1", "--run-dir", str(run_dir),
                *_args(KILL_STEPS), env=ray_env)
    log = run_dir / "worker-1.log"
    code = _kill_actor_and_finish(run, run_dir, log)
    assert code == 0, "".join(run.out + run.err)
    assert "restarted ray actor" in log.read_text()
    records = _identical_every_step(run_dir, KILL_STEPS)
    expected = {r["step"]: r for r in read_metrics(tmp_path / "ref")}
    for r in records:
        assert set(r["checksums"]) == set(expected[r["step"]]["checksums"]), r["step"]
    assert _checksum(run_dir) == _checksum(tmp_path / "ref")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_steps"] == 0 and summary["rejoins"] == 1
    assert records[-1]["hosts"] == [0, 1]       # pod 1 computes its own shard again
    _wait_nothing_left()


def test_an_actor_gone_for_good_is_replaced_where_ray_places_it_and_hot_swapped(cluster, ray_env, tmp_path):
    """Pod 1's actor is killed without restart (a node lost for good): the launcher asks Ray for a
    replacement pod, started with --spare at ports of its own and offered to the run, which
    hot-swaps slot 1 to it; the run ends bitwise as `multipod local`'s, with nothing left behind.
    From step REJOIN_BY the controller waits for the failed slot to be ready (a test hook), so the
    swap is an event the run waits for, however slow the machine."""
    steps, rejoin_by = 200, "150"
    reference = run_cli("local", "--pods", "2", "--devices-per-pod", "1", "--run-dir", str(tmp_path / "ref"),
                        *_args(steps), env=ray_env, timeout=600)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    run_dir = tmp_path / "ray"
    run = _Live("ray", "--address", cluster, "--pods", "2", "--devices-per-host", "1", "--run-dir", str(run_dir),
                *_args(steps), env=dict(ray_env, MULTIPOD_TEST_REJOIN_BY_STEP=rejoin_by))
    try:
        _wait_for_step(run.proc, run_dir, 20)
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("multipod-") and a["name"].endswith("-pod1-host0")]
        old = re.findall(r"serving on ([\d.]+:\d+)", (run_dir / "worker-1.log").read_text())[-1]
        ray.kill(ray.get_actor(name, namespace=a_namespace(name)), no_restart=True)
        run.wait_for("asked for a replacement", 120)
        run.wait_for("hot-swap: slot 1 trains again", 300)
        code = run.finish(600)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert code == 0, "".join(run.out + run.err)
    _identical_every_step(run_dir, steps)
    assert _checksum(run_dir) == _checksum(tmp_path / "ref")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (swap,) = [e for e in events if e["event"] == "hot_swap"]
    assert swap["slot"] == 1 and swap["old_address"] == old and swap["new_address"] != old
    assert "pod 1: a spare takes this slot" in (run_dir / "spare-1.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_steps"] == 0 and summary["hot_swaps"] == 1
    _wait_nothing_left()


def a_namespace(name: str) -> str:
    return next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name)


@pytest.mark.slow
def test_pods_of_two_hosts_a_killed_host_restarts_its_pod_which_rejoins(cluster, ray_env, tmp_path):
    """2 pods x 2 hosts packed on this one node: host 1 of pod 1 loses its actor; the pod's other
    host is stopped too (one jax.distributed cluster per pod), Ray restarts both, and the pod
    rejoins; the run ends bitwise as `multipod local`'s 2 x 2 run."""
    steps = 600
    reference = run_cli("local", "--pods", "2", "--hosts-per-pod", "2", "--devices-per-host", "1",
                        "--run-dir", str(tmp_path / "ref"), *_args(steps), env=ray_env, timeout=600)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    run_dir = tmp_path / "ray"
    run = _Live("ray", "--address", cluster, "--pods", "2", "--hosts-per-pod", "2", "--placement-strategy", "PACK",
                "--devices-per-host", "1", "--run-dir", str(run_dir), *_args(steps), env=ray_env)
    code = _kill_actor_and_finish(run, run_dir, run_dir / "worker-1-host-1.log")
    assert code == 0, "".join(run.out + run.err)
    for host in (0, 1):     # both hosts of pod 1 came back, each once
        assert (run_dir / f"worker-1-host-{host}.log").read_text().count("restarted ray actor") == 1
    _identical_every_step(run_dir, steps)
    assert _checksum(run_dir) == _checksum(tmp_path / "ref")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_steps"] == 0 and summary["rejoins"] == 1
    _wait_nothing_left()
