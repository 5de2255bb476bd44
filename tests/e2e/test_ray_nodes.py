"""End to end, slow: `multipod ray` on a Ray cluster of two nodes simulated on this machine
(ray.cluster_utils.Cluster: a head and a second raylet, one CPU each, so each pod gets a node).
The node of one pod goes away mid-run and nothing is left to place that pod on: the controller
says so at the placement deadline and the run ends on the surviving pod, bitwise as the
uninterrupted run (degraded mode)."""
from __future__ import annotations

import json
import os

import pytest
import ray

from tests.e2e.test_ray import _args, _checksum, _identical_every_step, _wait_nothing_left
from tests.e2e.test_recovery import _Live, _wait_for_step
from tests.helpers import run_cli

pytestmark = pytest.mark.slow

STEPS = 3000


@pytest.fixture(scope="module")
def two_nodes(env):
    """(the cluster, its second node); Ray's token authentication off, as in test_ray.py."""
    from ray.cluster_utils import Cluster
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster, node
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _pod_on(node_id: str) -> int:
    """The pod whose placement group is on the node `node_id`."""
    from ray.util import placement_group_table
    for group in placement_group_table().values():
        if group["name"].startswith("multipod-") and group["state"] == "CREATED" \
                and node_id in group["bundles_to_node_id"].values():
            return int(group["name"].rsplit("pod", 1)[1])
    raise AssertionError(f"no pod on node {node_id}: {placement_group_table()}")


def test_a_pod_whose_node_is_gone_is_reported_and_the_survivor_finishes(two_nodes, env, tmp_path):
    cluster, node = two_nodes
    ray_env = dict(env, RAY_AUTH_MODE="disabled")
    extra = ("--set", "recovery.restart_timeout_s=8")    # how long the controller waits for the pod to serve again
    reference = run_cli("local", "--pods", "2", "--devices-per-pod", "1", "--run-dir", str(tmp_path / "ref"),
                        *_args(STEPS, *extra), env=ray_env, timeout=600)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    run_dir = tmp_path / "ray"
    run = _Live("ray", "--address", cluster.address, "--pods", "2", "--devices-per-host", "1", "--place-timeout", "5",
                "--run-dir", str(run_dir), *_args(STEPS, *extra), env=ray_env)
    try:
        _wait_for_step(run.proc, run_dir, 20)
        lost = _pod_on(node.node_id)
        cluster.remove_node(node, allow_graceful=False)
        run.wait_for("degraded: 1/2 pods", 120)
        said = run.wait_for(f"pod {lost}: Ray could not place it again within 5s", 120)
        code = run.finish(600)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    out = "".join(run.out)
    assert code == 0, out + "".join(run.err)
    assert "the run goes on with the surviving pods" in said
    assert f"pod {lost} stays out" in out
    records = _identical_every_step(run_dir, STEPS)
    assert records[-1]["live_pods"] == 1
    assert _checksum(run_dir) == _checksum(tmp_path / "ref")
    assert json.loads((run_dir / "summary.json").read_text())["lost_steps"] == 0
    _wait_nothing_left()
