"""`multipod ray`'s pure logic: the resources JSON, the request and capacity checks, the worker's
command line, and what the monitor says about a pod that Ray does not bring back. No Ray
cluster here (tests/e2e/test_ray.py runs one)."""
from __future__ import annotations

import importlib
import pathlib
import threading

import pytest

from multipod.controller.launch.local import LaunchError
from multipod.controller.launch.ray_cluster import actor_options, check_capacity, check_request, parse_resources
from multipod.controller.launch.ray_pods import RayPods
from multipod.controller.launch.ray_worker import HostSpec


def test_resources_parse_as_a_json_object_of_amounts():
    assert parse_resources('{"TPU": 4}') == {"TPU": 4.0}
    assert parse_resources('{"GPU": 8, "CPU": 8, "memory": 1e9}') == {"GPU": 8.0, "CPU": 8.0, "memory": 1e9}


@pytest.mark.parametrize("text, says", [
    ("TPU=4", "not JSON"),
    ("[4]", "a JSON object"),
    ("{}", "a JSON object"),
    ('{"CPU": -1}', "'CPU' must be a number >= 0"),
    ('{"CPU": "1"}', "'CPU' must be a number >= 0"),
    ('{"CPU": true}', "'CPU' must be a number >= 0"),
    ('{"CPU": 0}', "every amount is 0"),
])
def test_bad_resources_are_refused_naming_the_problem(text, says):
    with pytest.raises(ValueError, match="--resources-per-host") as info:
        parse_resources(text)
    assert says in str(info.value)


def test_actor_options_put_each_resource_under_its_keyword():
    assert actor_options({"CPU": 1.0}) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert actor_options({"GPU": 8.0, "memory": 2.0}) == {"num_cpus": 0.0, "num_gpus": 8.0, "memory": 2.0}
    # A TPU host asks for no CPU: the actor must not ask for Ray's default of one CPU either.
    assert actor_options({"TPU": 4.0}) == {"num_cpus": 0.0, "num_gpus": 0.0, "resources": {"TPU": 4.0}}


@pytest.mark.parametrize("args, says", [
    ((0, 1, "PACK", 0), "--pods must be >= 1"),
    ((2, 0, "PACK", 0), "--hosts-per-pod must be >= 1"),
    ((2, 1, "PACK", -1), "--devices-per-host must be >= 0"),
    ((2, 1, "SCATTER", 0), "--placement-strategy must be one of STRICT_SPREAD"),
])
def test_bad_requests_are_refused_before_ray_is_contacted(args, says):
    with pytest.raises(ValueError, match=says):
        check_request(*args)


def test_capacity_names_the_resource_that_is_short_and_the_strategy_that_cannot_fit():
    check_capacity(2, 2, "STRICT_SPREAD", {"TPU": 4.0}, {"TPU": 16.0, "CPU": 8.0}, nodes=4)
    with pytest.raises(LaunchError, match=r"that is 20 TPU in all, and the cluster has 16"):
        check_capacity(5, 1, "PACK", {"TPU": 4.0}, {"TPU": 16.0}, nodes=4)
    with pytest.raises(LaunchError, match=r"1 GPU in all, and the cluster has 0"):
        check_capacity(1, 1, "PACK", {"GPU": 1.0}, {"CPU": 4.0}, nodes=1)
    with pytest.raises(LaunchError, match=r"the Ray cluster has 1 node\(s\).*--placement-strategy PACK"):
        check_capacity(1, 2, "STRICT_SPREAD", {"CPU": 1.0}, {"CPU": 4.0}, nodes=1)
    check_capacity(1, 2, "PACK", {"CPU": 1.0}, {"CPU": 4.0}, nodes=1)


def test_the_worker_command_line_holds_no_secret_and_the_pod_s_layout():
    spec = HostSpec(run_id="r1", pod=1, host=1, hosts_per_pod=2, listen_host="10.0.0.2", port=5001, dcn_port=5002,
                    coordinator="10.0.0.1:5003", devices=0, log_path="/runs/x/worker-1-host-1.log",
                    flags=("--dcn-encrypt",))
    cmd = spec.command(pathlib.Path("/tmp/p"))
    assert cmd[cmd.index("--listen") + 1] == "10.0.0.2:5001"
    assert cmd[cmd.index("--dcn-listen") + 1] == "10.0.0.2:5002"
    assert cmd[cmd.index("--pod-coordinator") + 1] == "10.0.0.1:5003"
    assert cmd[cmd.index("--host-index") + 1] == "1" and "--dcn-encrypt" in cmd and "--exit-with-parent" in cmd
    assert not any("token" in part for part in cmd)
    single = HostSpec(run_id="r1", pod=0, host=0, hosts_per_pod=1, listen_host="127.0.0.1", port=1, dcn_port=2,
                      coordinator="", devices=1, log_path="/x")
    assert "--pod-coordinator" not in single.command(pathlib.Path("/tmp/p"))


class _Actor:
    def __init__(self):
        self.killed: list = []     # the pids kill_worker was called with
        self.kill_worker = self

    def remote(self, pid=None):
        self.killed.append(pid)


def _pods(hosts: int, printed: list[str], monkeypatch) -> RayPods:
    monkeypatch.setattr("multipod.controller.launch.ray_pods.out", printed.append)
    pods = RayPods(None, 2, hosts, {"CPU": 1.0}, pathlib.Path("/runs/x"), place_timeout_s=10, max_restarts=3)
    pods.actors = [[_Actor() for _ in range(hosts)] for _ in range(2)]
    pods.pids = [[100 * pod + host for host in range(hosts)] for pod in range(2)]
    return pods


def test_a_pod_down_past_the_deadline_is_reported_once_then_its_return(monkeypatch):
    printed: list[str] = []
    pods = _pods(1, printed, monkeypatch)
    down = [("down", "Ray is restarting its actor")]
    pods.check(1, down, now=100.0)
    pods.check(1, down, now=109.0)
    assert printed == []                    # within the deadline: Ray may still bring it back
    pods.check(1, down, now=111.0)
    pods.check(1, down, now=150.0)
    assert printed == ["pod 1: Ray could not place it again within 10s (host 0: Ray is restarting its actor); "
                       "the run goes on with the surviving pods"]
    pods.check(1, [("up", "")], now=160.0)
    assert printed[-1] == "pod 1: Ray has placed it again"
    pods.check(0, [("up", "")], now=160.0)
    assert len(printed) == 2                # a pod that never went down is not mentioned


def test_a_pod_ray_will_not_restart_is_reported_at_once_and_replaced_once(monkeypatch):
    printed: list[str] = []
    pods = _pods(1, printed, monkeypatch)
    asked: list[int] = []
    replaced = threading.Event()
    monkeypatch.setattr(pods, "_replace", lambda pod: (asked.append(pod), replaced.set()))
    pods.check(0, [("dead", "max_restarts reached")], now=0.0)
    pods.check(0, [("dead", "max_restarts reached")], now=100.0)
    assert printed == ["pod 0: it cannot rejoin (host 0's actor is gone: max_restarts reached; --max-restarts 3 "
                       "per host); the run goes on with the surviving pods, and Ray is asked for a replacement"]
    assert replaced.wait(10) and asked == [0]      # once: the second look asks nothing more


def test_when_one_host_of_a_pod_goes_down_its_other_hosts_are_stopped_once(monkeypatch):
    pods = _pods(2, [], monkeypatch)
    pods.check(0, [("down", "its worker exited"), ("up", "")], now=0.0)
    pods.check(0, [("down", "Ray is restarting its actor"), ("up", "")], now=1.0)
    # The pod restarts as a whole, once; only the worker seen up is killed (its actor may have
    # restarted since, and the new worker must live).
    assert [a.killed for a in pods.actors[0]] == [[], [1]]
    assert [a.killed for a in pods.actors[1]] == [[], []]


def test_a_restart_between_two_looks_stops_the_pod_s_other_hosts_and_their_restarts_are_expected(monkeypatch):
    pods = _pods(2, [], monkeypatch)
    pods.pids[0] = [10, 11]
    # Host 1's worker (pid 11) restarted between two looks (now pid 17): never seen down.
    pods.look(0, [("up", "", 10), ("up", "", 17)], now=0.0)
    assert [a.killed for a in pods.actors[0]] == [[10], []]      # host 0 stopped, by its pid of that look
    # Host 0 is still up with its old worker (the stop is on its way): the pod is not back yet, and
    # nothing more is stopped.
    pods.look(0, [("up", "", 10), ("up", "", 17)], now=1.0)
    assert 0 in pods._down_since and [a.killed for a in pods.actors[0]] == [[10], []]
    # Host 0 comes back with a new worker: the restart asked for, not a new failure; the pod is whole.
    pods.look(0, [("up", "", 18), ("up", "", 17)], now=2.0)
    assert 0 not in pods._down_since and [a.killed for a in pods.actors[0]] == [[10], []]
    assert pods.pids[0] == [18, 17]
    # A later restart of host 0 that nobody asked for stops host 1 again.
    pods.look(0, [("up", "", 19), ("up", "", 17)], now=3.0)
    assert [a.killed for a in pods.actors[0]] == [[10], [17]]


def test_a_disconnect_that_hangs_is_said_and_not_waited_on(capsys):
    from multipod.controller.launch.ray_context import _disconnect
    release = threading.Event()

    class StuckRay:
        def shutdown(self):
            release.wait(30)
    try:
        _disconnect(StuckRay(), timeout_s=0.2)
    finally:
        release.set()
    assert "disconnecting from the Ray cluster did not finish within 0.2s" in capsys.readouterr().out

    calls = []

    class Ray:
        def shutdown(self):
            calls.append("shutdown")
    _disconnect(Ray(), timeout_s=5)
    assert calls == ["shutdown"] and "did not finish" not in capsys.readouterr().out


class _FakeRay:
    """What RayPods._ready uses of ray: get(ref, timeout) and the exceptions it tells apart."""

    class exceptions:
        class RayError(Exception):
            pass

        class GetTimeoutError(RayError):
            pass

        class ActorUnavailableError(RayError):
            pass

        class RayTaskError(RayError):
            cause = "boom"

    def get(self, ref, timeout):
        return ref()


class _StartingActor:
    """An actor whose first `dies` ready() calls find it restarting (its worker could not listen)."""

    def __init__(self, name: str, dies: int, **info):
        self.name, self.dies, self.calls, self.info = name, dies, 0, info
        self.ready = self

    def remote(self, timeout_s):
        self.calls += 1
        def answer():
            if self.calls <= self.dies:
                raise _FakeRay.exceptions.ActorUnavailableError("The actor is temporarily unavailable")
            return {"address": self.name, **self.info}
        return answer


def test_an_actor_that_dies_while_starting_is_asked_again_of_its_restarted_incarnation(monkeypatch):
    monkeypatch.setattr("multipod.controller.launch.ray_pods.time.sleep", lambda s: None)
    printed: list[str] = []
    monkeypatch.setattr("multipod.controller.launch.ray_pods.out", printed.append)
    pods = RayPods(_FakeRay(), 2, 1, {"CPU": 1.0}, pathlib.Path("/runs/x"), max_restarts=2)
    actors = [_StartingActor("a0", dies=1), _StartingActor("a1", dies=0)]
    assert pods._ready(actors) == [{"address": "a0"}, {"address": "a1"}]
    assert [a.calls for a in actors] == [2, 1]
    assert printed == ["pod 0's actor died while starting; asking its restarted incarnation (see /runs/x/worker-0.log)"]
    # Past max_restarts the start fails, naming the pod and how often its actor died.
    with pytest.raises(LaunchError, match=r"could not start pod 1: its actor died while starting 3 times"):
        pods._ready([_StartingActor("b0", dies=0), _StartingActor("b1", dies=5)])


class _Group:
    def ready(self):
        return "placed"


class _SparesRay(_FakeRay):
    """_FakeRay plus what a replacement's start uses: wait on its group, remote() of the host
    class (each host's actor dies while starting as often as `dies` says), kill."""

    def __init__(self, dies: list[int]):
        self.dies, self.started, self.killed = dies, [], []

    def wait(self, refs, num_returns=1, timeout=None):
        return refs, []

    def remote(self, cls):
        ray = self

        class Options:
            def options(self, **kwargs):
                return self

            def remote(self, spec, token):
                actor = _StartingActor(spec, ray.dies[len(ray.started)], node="10.0.0.9", pid=len(ray.started))
                ray.started.append(actor)
                return actor
        return Options()

    def kill(self, actor, no_restart):
        self.killed.append(actor)


def _replacing(dies: list[int], tmp_path, monkeypatch) -> tuple[RayPods, _SparesRay, list[str]]:
    monkeypatch.setattr("multipod.controller.launch.ray_pods.time.sleep", lambda s: None)
    printed: list[str] = []
    monkeypatch.setattr("multipod.controller.launch.ray_pods.out", printed.append)
    monkeypatch.setattr("multipod.controller.launch.ray_replacement.out", printed.append)
    # The module, not ray.util's function of the same name that shadows it as an attribute.
    groups = importlib.import_module("ray.util.placement_group")
    monkeypatch.setattr(groups, "placement_group", lambda *a, **k: _Group())
    monkeypatch.setattr(groups, "remove_placement_group", lambda group: None)
    ray = _SparesRay(dies)
    pods = RayPods(ray, 2, len(dies), {"CPU": 1.0}, tmp_path, max_restarts=2)
    monkeypatch.setattr(pods, "_host_specs", lambda groups, spare: [[f"10.0.0.9:{7000 + h}" for h in range(len(dies))]])
    return pods, ray, printed


def test_a_replacement_whose_actor_dies_while_starting_is_asked_again_and_offered(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    pods, ray, printed = _replacing([0, 1], tmp_path, monkeypatch)
    pods._replacing.add(1)
    pods._replace(1)
    assert [a.calls for a in ray.started] == [1, 2] and ray.killed == []
    assert (tmp_path / "spares").read_text() == "10.0.0.9:7000,10.0.0.9:7001\n"
    assert printed[0] == ("spare 1 host 1's actor died while starting; asking its restarted incarnation "
                          f"(see {tmp_path.absolute()}/spare-1-host-1.log)")
    assert printed[1].startswith("pod 1: Ray placed a replacement (spare 1) at 10.0.0.9:7000,10.0.0.9:7001")


def test_a_replacement_that_keeps_dying_is_given_up_naming_the_spare_and_its_actors_are_killed(tmp_path,
                                                                                              monkeypatch):
    pytest.importorskip("ray")
    pods, ray, printed = _replacing([9], tmp_path, monkeypatch)
    pods._replacing.add(0)
    pods._replace(0)
    assert ray.killed == ray.started and 0 not in pods._replacing and not (tmp_path / "spares").exists()
    assert printed[-1].startswith("pod 0: no replacement: could not start spare 1: its actor died while starting "
                                  "3 times")
