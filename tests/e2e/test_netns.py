"""End to end: `multipod local --netns`, every host of every pod in a network namespace of its
own, over kernel links through a bridge (controller/launch/netns.py), with TLS and CURVE on the
run's own certificates.

Pods of two hosts in namespaces train bitwise as the same run on loopback, through a pod killed
with -9 (degraded mode, and a spare pod at other addresses taking its slot across namespaces); a
worker in a namespace without encryption and without --insecure refuses to start; and nothing is
left behind (namespaces, links, /etc/netns files, processes) after a run, after an error and
after Ctrl-C. These tests need root (CI runs as root) and skip, saying why, only where
namespaces cannot be made."""
from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from multipod.controller.launch import netns
from multipod.controller.launch.local import LaunchError
from multipod.controller.launch.netns import ETC_NETNS, NetnsError, Network, leftovers, wait_gone
from multipod.controller.launch.netns_pods import NetnsPods
from multipod.protos.channels import Security
from tests.e2e.pod_failure import held_env, kill_and_finish
from tests.e2e.test_hosts import COMMON, STEPS, TWO_HOSTS, two_hosts_reference
from tests.e2e.test_recovery import _events, _Live
from tests.helpers import ROOT, TINY, cli_argv, pid_alive, read_metrics, require_namespaces, run_cli

# As test_hosts runs them (evaluated, with the closing sample): its shared run is the reference.
ONE_HOST = ("--pods", "2", "--devices-per-pod", "2")


@pytest.fixture(scope="module", autouse=True)
def namespaces_can_be_made():
    """Skip (saying why) where this machine cannot make a namespace; elsewhere every test runs."""
    require_namespaces()


def _run_id(stdout: str) -> str:
    """The run's id from the start's message (its namespaces are multipod-ID-*)."""
    match = re.search(r"in network namespaces multipod-(\d+-\d+)-\*", stdout)
    assert match, stdout
    return match.group(1)


def _nothing_left(run_id: str, pids: list[int]) -> None:
    assert not wait_gone(run_id), f"left behind: {leftovers(run_id)}"
    assert not list(ETC_NETNS.glob(f"multipod-{run_id}-*"))
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "workers left behind"


def _wait_inside(pid: int, namespace: str, deadline_s: float = 10.0) -> None:
    """Wait until `pid` has entered `namespace`: `ip netns exec` opens the namespace before it
    joins it, so a namespace removed in between would leave the process running outside it."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        listed = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True)
        if namespace in listed.stdout.split():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not enter {namespace} within {deadline_s} s")


def _pids(run_dir) -> list[int]:
    return [int(p) for pattern in ("worker-*.log", "spare-*.log") for log in run_dir.glob(pattern)
            for p in re.findall(r"\(pid (\d+)\)", log.read_text())]


def test_the_network_is_shaped_reachable_and_removed_and_a_killed_run_s_is_cleaned(tmp_path):
    network = Network(2, 2, rate_gbps=0.5)
    try:
        layout = network.create()
        run_id = network.run_id
        assert set(layout.namespaces) <= set(netns._namespaces("ip"))
        qdiscs = subprocess.run(["tc", "-n", layout.bridge_namespace, "qdisc", "show"], capture_output=True,
                                text=True, check=True).stdout
        for pod in range(2):     # the pod's link, shaped at both ends: out of the pod and into it
            for end in (f"p{pod}up", f"p{pod}dcn"):
                assert re.search(rf"tbf \S+ dev {end} root .*rate 500Mbit", qdiscs), qdiscs
        assert "tbf" not in "".join(line for line in qdiscs.splitlines() if " dev p0h" in line)
        # A host's name resolves to its own address in its namespace (gloo binds to it), and the
        # controller reaches a listener there over the bridge.
        code = ("import socket, sys; s = socket.socket(); s.bind((socket.gethostbyname(socket.gethostname()), 0)); "
                "s.listen(); print(s.getsockname()[0], s.getsockname()[1], flush=True); c, _ = s.accept(); "
                "c.sendall(c.recv(5)); c.close()")
        server = subprocess.Popen(network.wrap(1, 1, [sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
        try:
            host, port = server.stdout.readline().split()
            assert host == layout.host_ip(1, 1)
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(b"hello")
                assert conn.recv(5) == b"hello"
            assert server.wait(timeout=10) == 0
        finally:
            server.kill()
        # The same range again, while it is in use: refused naming it, and nothing made.
        again = Network(1, 1, subnet=str(layout.subnet))
        with pytest.raises(NetnsError, match=rf"--netns-subnet {layout.subnet} is already used on this machine"):
            again.create()
        again.destroy()
        assert not leftovers(again.run_id)
    finally:
        network.destroy()
    assert not wait_gone(run_id) and not list(ETC_NETNS.glob(f"multipod-{run_id}-*"))

    # A run whose controller was killed leaves its network: the next run's start removes it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Network(1, 1)
    stale.run_id = f"{dead.pid}-0"
    stale.create()
    sleeper = subprocess.Popen(stale.wrap(0, 0, ["sleep", "600"]))
    try:
        _wait_inside(sleeper.pid, f"multipod-{dead.pid}-0-p0h0")
        removed = netns.clean_stale()
        assert f"multipod-{dead.pid}-0-p0h0" in removed and f"mp{dead.pid}-0" in removed
        assert not wait_gone(stale.run_id)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL     # what ran in it is gone too
    finally:
        sleeper.kill()
        stale.destroy()


@pytest.fixture(scope="module")
def loopback(tmp_path_factory, env):
    """The reference: the same run on loopback, uninterrupted (test_hosts' shared run)."""
    return two_hosts_reference(tmp_path_factory, env).run_dir


def test_pods_of_two_hosts_in_namespaces_lose_a_pod_and_train_bitwise_as_on_loopback(loopback, tmp_path, env):
    # One run for four claims: pods in namespaces over shaped links, with TLS and CURVE, train
    # bitwise as on loopback; pods of two hosts work across namespaces; a pod killed with -9 (host
    # 1 of pod 1, once step 2 is recorded) leaves the run degraded; and the spare pod, in
    # namespaces of its own at other addresses, takes its slot from a live peer's state across
    # namespaces (hot-swap; from step 5 the controller waits for the slot: a test hook), the run
    # still bitwise equal to the uninterrupted one. A pod restarting in place and rejoining is
    # test_hosts.py's (on loopback); its spare test runs on loopback only where this one skips.
    run_dir = tmp_path / "run"
    hold = tmp_path / "hold"       # the kill lands before step 3 (a test hook too)
    run = _Live("local", "--netns", "--netns-rate-gbps", "1", *TWO_HOSTS, *COMMON, "--spares", "1", "--no-report",
                "--run-dir", str(run_dir), env=held_env(dict(env, MULTIPOD_TEST_REJOIN_BY_STEP="5"), hold, 3))

    def host_1_of_pod_1() -> int:
        return int(re.findall(r"\(pid (\d+)\)", (run_dir / "worker-1-host-1.log").read_text())[-1])

    code = kill_and_finish(run, run_dir, host_1_of_pod_1, "degraded: 1/2 pods", step=2, hold=hold)
    out = "".join(run.out)
    assert code == 0, out + "".join(run.err)
    assert "links shaped to 1 Gb/s, TLS + CURVE" in out
    records, expected = read_metrics(run_dir), {r["step"]: r for r in read_metrics(loopback)}
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert set(r["checksums"]) == set(expected[r["step"]]["checksums"]), r["step"]
        if not r.get("partial_loss"):
            assert r["loss"] == expected[r["step"]]["loss"], r["step"]
    assert json.loads((run_dir / "summary.json").read_text())["checksum"] == \
        json.loads((loopback / "summary.json").read_text())["checksum"]
    assert any(r["hosts"][1] != 1 for r in records) and records[-1]["hosts"] == [0, 1]
    events = _events(run_dir)
    assert [e["pods"] for e in events if e["event"] == "pod_failure"] == [[1]]
    assert [e["pods"] for e in events if e["event"] == "rejoin"] == [[1]]
    addresses = {}
    for name in ("worker-0", "worker-1", "spare-0"):
        for host in range(2):     # each once, on its namespace's own address, encrypted
            log = (run_dir / f"{name}-host-{host}.log").read_text()
            served = re.findall(r"serving on ([\d.]+:\d+) \(pid \d+\), data plane on (\S+)", log)
            assert len(served) == 1, served
            assert not served[0][0].startswith("127.") and served[0][1].startswith("curve://"), served
            assert "UNENCRYPTED" not in log
            addresses.setdefault(name, []).append(served[0][0])
    (swap,) = [e for e in events if e["event"] == "hot_swap"]
    assert swap["slot"] == 1 and swap["old_address"] == ",".join(addresses["worker-1"])
    assert swap["new_address"] == ",".join(addresses["spare-0"])
    # The spare pod (a jax.distributed cluster of its own) was checked, waited, then took the slot
    # host by host; the failed pod's other host was stopped, never restarted (served once, above).
    # test_hosts.py's spare test, which this run replaces where namespaces can be made.
    assert [e["spare"] for e in events if e["event"] == "spare_ready"] == [swap["new_address"]]
    for host in range(2):
        assert f"pod 1 host {host}: a spare takes this slot" in (run_dir / f"spare-0-host-{host}.log").read_text()
    assert {a.split(":")[0] for a in addresses["spare-0"]}.isdisjoint(a.split(":")[0] for a in addresses["worker-1"])
    assert not (run_dir / ".tls").exists()       # the run's keys went with it
    _nothing_left(_run_id(out), _pids(run_dir))


def test_a_worker_in_a_namespace_refuses_to_listen_unencrypted_and_nothing_is_left(tmp_path):
    pods = NetnsPods(1, 1, tmp_path, security=Security(token="token-for-the-netns-test-0123"), encrypt=False)
    with pytest.raises(LaunchError) as error:
        with pods:
            pass
    message = str(error.value)
    assert "refusing to listen beyond loopback unencrypted" in message, message
    assert "without TLS" in message and "without encryption (--dcn-encrypt)" in message
    _nothing_left(pods.network.run_id, [proc.pid for proc in pods.procs])


def test_without_the_tools_or_the_permission_the_run_names_what_is_missing(tmp_path, env):
    # No `ip` on PATH, and the two capabilities dropped (setpriv, util-linux): refused before
    # any data is read or any worker starts.
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) drops the capabilities for this test"
    result = subprocess.run([setpriv, "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-net_admin,-sys_admin",
                             sys.executable, "-m", "multipod.cli", "local", "--netns", *ONE_HOST, *COMMON,
                             "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env=dict(env, PATH=str(tmp_path)), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "--netns cannot make network namespaces here: missing the `ip` command (iproute2) on PATH" in result.stderr
    assert "CAP_NET_ADMIN" in result.stderr and "CAP_SYS_ADMIN" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
    refused = run_cli("local", "--netns-rate-gbps", "1", *ONE_HOST, *COMMON, "--run-dir", str(tmp_path / "x"))
    assert refused.returncode == 2 and "--netns-rate-gbps: only goes with --netns" in refused.stderr


def test_ctrl_c_removes_every_namespace_link_and_worker(tmp_path, env):
    # Pods of one host (the other layout), in namespaces: they train, identical, until Ctrl-C.
    proc = subprocess.Popen(cli_argv("local", "--netns", "--pods", "2", "--devices-per-pod", "1", "--config", TINY,
                                     "--steps", "100000", "--set", "sample.tokens=0", "--run-dir", str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    run_id = f"{proc.pid}-0"        # the controller's pid names its namespaces
    try:
        deadline = time.monotonic() + 180
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        whole = [json.loads(line) for line in metrics.read_text().splitlines(keepends=True) if line.endswith("\n")]
        assert all(len(set(r["checksums"])) == 1 for r in whole if "checksums" in r)
        pids = _pids(tmp_path)
        assert len(pids) == 2 and all(pid_alive(p) for p in pids) and leftovers(run_id)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert f"multipod-{run_id}-*" in out
    _nothing_left(run_id, pids)

