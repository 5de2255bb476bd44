"""Pods of several hosts on the controller's side: PodClient fans every RPC out to the pod's hosts
(each its own rows of a step, its own host index and data-plane peers), checks that they agree on
the pod's layout and names the host that fails; --workers lists each pod's hosts; LocalPods starts
and restarts a pod's hosts together."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import grpc
import numpy as np
import pytest

from multipod import protos
from multipod.controller.cluster.addresses import parse_workers, pod_hosts
from multipod.controller.cluster.client import Probe, Verdict, WorkerClient, WorkerError
from multipod.controller.cluster.pod_client import PodClient, make_pod_client
from multipod.controller.cluster.pods import Cluster
from multipod.controller.commands.train import local_devices
from multipod.controller.core.errors import RunError
from multipod.controller.launch.local import LocalPods
from multipod.model.config import ConfigError
from multipod.protos import codec, multipod_pb2 as pb
from multipod.protos.channels import Security
from tests.unit.controller.fakes import DEAD, HUNG, SERVING, FakeCall, configure_reply, make_config, step_reply


class FakeHost:
    """One host of a pod, with the part of the PodApi interface PodClient uses: it records every
    request as (RPC name, request); `replies` maps an RPC's name to a reply or a WorkerError (or
    "pending": the call never finishes)."""

    def __init__(self, pod: int, host: int, hosts: int = 2, probe: Probe = SERVING, **status):
        self.pod_index, self.host_index = pod, host
        self.address = f"fake:{pod}.{host}"
        self.name = f"pod {pod} host {host} ({self.address})"
        self.requests: list[tuple[str, object]] = []
        self.replies: dict = {"Step": step_reply(pod, 0), "Configure": configure_reply(pod),
                              "Save": pb.SaveReply(path=f"ckpt-{pod}.{host}")}
        self._probe = probe
        self.status_reply = pb.StatusReply(**{
            **dict(protocol_version=protos.PROTOCOL_VERSION, pod_index=pod, configured=True, host_index=host,
                   hosts_per_pod=hosts, pod_coordinator=f"fake:{pod}.0:9000", local_devices=1,
                   num_devices=hosts, dcn_address=f"tcp://dcn:{pod}.{host}"), **status})
        self.closed = False

    def _answer(self, method: str, request) -> FakeCall:
        self.requests.append((method, request))
        reply = self.replies[method]
        if isinstance(reply, str):
            return FakeCall(pending=True)
        if isinstance(reply, Exception):
            return FakeCall(error=reply)
        return FakeCall(reply)

    def step_async(self, request: pb.StepRequest, timeout_s: float) -> FakeCall:
        return self._answer("Step", request)

    def configure_async(self, request: pb.ConfigureRequest, timeout_s: float) -> FakeCall:
        return self._answer("Configure", request)

    def save_async(self, request: pb.SaveRequest, timeout_s: float) -> FakeCall:
        return self._answer("Save", request)

    def send_state_async(self, request: pb.SendStateRequest, timeout_s: float) -> FakeCall:
        return self._answer("SendState", request)

    def generate_stream(self, request: pb.GenerateRequest, timeout_s: float):
        self.requests.append(("GenerateStream", request))
        reply = self.replies["GenerateStream"]
        if isinstance(reply, Exception):
            raise reply
        yield from reply

    def status(self, timeout_s: float = 5.0) -> pb.StatusReply:
        return self.status_reply

    def probe(self, timeout_s: float):
        return self._probe

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def wait_serving(self, timeout_s: float, probe_s: float = 5.0) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _pod(pod: int = 1, hosts: int = 2, **status) -> PodClient:
    return PodClient(pod, [FakeHost(pod, h, hosts, **status) for h in range(hosts)])


def _tokens(rows: int, base: int = 0) -> np.ndarray:
    return (base + np.arange(rows * 9, dtype=np.int32)).reshape(rows, 9)


# ---- names -------------------------------------------------------------------------------------

def test_a_pod_of_several_hosts_is_named_by_all_its_addresses():
    pod = _pod(1)
    assert pod.name == "pod 1 (fake:1.0,fake:1.1)" and pod.address == "fake:1.0,fake:1.1" and pod.pod_index == 1
    pod.close()
    assert all(host.closed for host in pod.hosts)


def test_a_one_host_pod_is_a_plain_worker_client_and_hosts_are_named():
    single = make_pod_client(0, ["127.0.0.1:1"])   # channels are lazy: nothing is contacted
    multi = make_pod_client(2, ["127.0.0.1:1", "127.0.0.1:2"])
    try:
        assert type(single) is WorkerClient and single.name == "pod 0 (127.0.0.1:1)"
        assert isinstance(multi, PodClient) and multi.name == "pod 2 (127.0.0.1:1,127.0.0.1:2)"
        assert [h.name for h in multi.hosts] == ["pod 2 host 0 (127.0.0.1:1)", "pod 2 host 1 (127.0.0.1:2)"]
    finally:
        single.close()
        multi.close()
    assert pod_hosts("a:1, b:1") == ["a:1", "b:1"] and pod_hosts(["a:1"]) == ["a:1"] and pod_hosts("a:1") == ["a:1"]


# ---- fan-out ------------------------------------------------------------------------------------

def test_step_gives_each_host_its_block_of_rows_of_every_shard():
    pod = _pod(1)
    own, extra = _tokens(4), _tokens(4, base=1000)
    request = pb.StepRequest(step=7, tokens=codec.encode(own), global_tokens=64, take_fingerprint=True,
                             extra_shards=[pb.Shard(slot=2, tokens=codec.encode(extra))])
    reply = pod.step_async(request, 10).result()
    assert reply == pod.hosts[0].replies["Step"]
    for h, host in enumerate(pod.hosts):
        [(method, got)] = host.requests
        assert method == "Step" and got.step == 7 and got.global_tokens == 64 and got.take_fingerprint
        np.testing.assert_array_equal(codec.decode(got.tokens), own[2 * h:2 * h + 2])
        assert [s.slot for s in got.extra_shards] == [2]
        np.testing.assert_array_equal(codec.decode(got.extra_shards[0].tokens), extra[2 * h:2 * h + 2])
    assert codec.decode(request.tokens).shape == (4, 9)     # the caller's request is left whole


def test_step_gives_each_host_its_block_of_the_loss_masks_too():
    # A prompt-tuning run's shards carry a loss mask per target: a host takes the mask of its rows.
    pod = _pod(1)
    mask, extra_mask = (np.random.default_rng(s).integers(0, 2, (4, 8), dtype=np.uint8) for s in (1, 2))
    request = pb.StepRequest(step=0, tokens=codec.encode(_tokens(4)), loss_mask=codec.encode(mask),
                             extra_shards=[pb.Shard(slot=0, tokens=codec.encode(_tokens(4)),
                                                    loss_mask=codec.encode(extra_mask))])
    pod.step_async(request, 10).result()
    for h, host in enumerate(pod.hosts):
        [(_, got)] = host.requests
        np.testing.assert_array_equal(codec.decode(got.loss_mask), mask[2 * h:2 * h + 2])
        np.testing.assert_array_equal(codec.decode(got.extra_shards[0].loss_mask), extra_mask[2 * h:2 * h + 2])
    pod.step_async(pb.StepRequest(step=1, tokens=codec.encode(_tokens(4))), 10).result()
    assert all(not host.requests[-1][1].loss_mask for host in pod.hosts)    # no mask: none sent


def test_step_rows_that_do_not_split_over_the_hosts_are_refused_before_any_host_is_called():
    pod = _pod(1)
    with pytest.raises(ConfigError, match=r"3 rows.*2 equal blocks.*multiple of the hosts per pod \(2\)") as info:
        pod.step_async(pb.StepRequest(step=0, tokens=codec.encode(_tokens(3))), 10)
    assert info.value.field == "data.global_batch" and "pod 1 (fake:1.0,fake:1.1)" in str(info.value)
    assert all(not host.requests for host in pod.hosts)


def test_configure_tells_each_host_its_index_and_its_peers_on_the_other_pods():
    pod = _pod(1)
    request = pb.ConfigureRequest(pod_index=1, num_pods=2, run_id="r.1", worker_config_json="{}",
                                  peer_addresses=["a,b", "c,d"], dcn_addresses=["tcp://p0h0|tcp://p0h1",
                                                                                "tcp://p1h0|tcp://p1h1"])
    assert pod.configure(request, 10) == configure_reply(1)
    for h, host in enumerate(pod.hosts):
        [(_, got)] = host.requests
        assert (got.host_index, got.hosts_per_pod, got.pod_index, got.run_id) == (h, 2, 1, "r.1")
        assert list(got.dcn_addresses) == [f"tcp://p0h{h}", f"tcp://p1h{h}"]
    with pytest.raises(RunError, match="pod 0's data-plane address 'tcp://x' lists 1 host"):
        pod.configure(pb.ConfigureRequest(dcn_addresses=["tcp://x", "tcp://p1h0|tcp://p1h1"]), 10)


def test_state_transfer_goes_host_to_host_and_other_requests_go_to_every_host_unchanged():
    pod = _pod(1)
    for host in pod.hosts:
        host.replies["SendState"] = pb.TransferReply(step=3)
    pod.send_state(pb.SendStateRequest(transfer_id="t", to_pod=0, to_address="tcp://p0h0|tcp://p0h1"), 10)
    assert [host.requests[0][1].to_address for host in pod.hosts] == ["tcp://p0h0", "tcp://p0h1"]
    save = pb.SaveRequest(step=5, directory="/ckpt", background=True)
    assert pod.save(save, 10).path == "ckpt-1.0"    # host 0's reply
    assert [host.requests[1] for host in pod.hosts] == [("Save", save), ("Save", save)]


def test_a_failure_on_one_host_fails_the_pods_call_naming_that_host():
    pod = _pod(1)
    error = WorkerError("pod 1 host 1 (fake:1.1): Step failed: INVALID_ARGUMENT: bad rows",
                        grpc.StatusCode.INVALID_ARGUMENT)
    pod.hosts[1].replies["Step"] = error
    pod.hosts[0].replies["Step"] = "pending"    # host 0 waits in the pod's collective
    call = pod.step_async(pb.StepRequest(tokens=codec.encode(_tokens(2))), 10)
    assert call.wait(30) and call.done()        # done: the pod failed, whatever host 0 still does
    with pytest.raises(WorkerError) as info:
        call.result()
    assert info.value is error and info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    call.cancel()
    assert pod.hosts[0].requests and all(c.cancelled for c in call.calls[:1])
    pod.hosts[1].replies["Save"] = error
    with pytest.raises(WorkerError, match=r"pod 1 host 1 \(fake:1.1\)"):
        pod.save(pb.SaveRequest(step=1), 10)


def test_a_pods_call_is_done_only_when_every_host_is():
    pod = _pod(1)
    pod.hosts[1].replies["Step"] = "pending"
    call = pod.step_async(pb.StepRequest(tokens=codec.encode(_tokens(2))), 10)
    assert not call.done() and not call.wait(0.01)
    call.calls[1].finish(step_reply(1, 0))
    assert call.wait(30) and call.result() == pod.hosts[0].replies["Step"]


def test_a_stream_runs_on_every_host_and_yields_host_0s_chunks_then_any_hosts_failure():
    pod = _pod(1)
    chunks = [pb.GenerateChunk(index=i, rows=[0]) for i in range(3)]
    pod.hosts[0].replies["GenerateStream"] = chunks
    pod.hosts[1].replies["GenerateStream"] = [pb.GenerateChunk(index=9)]
    request = pb.GenerateRequest(num_tokens=3)
    assert list(pod.generate_stream(request, 10)) == chunks
    assert [host.requests for host in pod.hosts] == [[("GenerateStream", request)]] * 2
    error = WorkerError("pod 1 host 1 (fake:1.1): GenerateStream failed: INTERNAL: boom", grpc.StatusCode.INTERNAL)
    pod.hosts[1].replies["GenerateStream"] = error
    with pytest.raises(WorkerError) as info:
        list(pod.generate_stream(request, 10))
    assert info.value is error


# ---- status -------------------------------------------------------------------------------------

def test_status_joins_the_hosts_data_plane_addresses_and_is_configured_only_if_every_host_is():
    pod = _pod(1)
    status = pod.status(1)
    assert status.dcn_address == "tcp://dcn:1.0|tcp://dcn:1.1" and status.configured and status.host_index == 0
    pod.hosts[1].status_reply.configured = False
    assert not pod.status(1).configured


def test_cluster_of_multi_host_pods_configures_each_host_with_its_peers():
    pods = [_pod(0), _pod(1)]
    cluster = Cluster(pods, make_config())
    cluster.configure()
    assert cluster.dcn_addresses == ["tcp://dcn:0.0|tcp://dcn:0.1", "tcp://dcn:1.0|tcp://dcn:1.1"]
    for pod in pods:
        for h, host in enumerate(pod.hosts):
            [(_, request)] = host.requests
            assert (request.pod_index, request.host_index, request.hosts_per_pod) == (pod.pod_index, h, 2)
            assert list(request.dcn_addresses) == [f"tcp://dcn:0.{h}", f"tcp://dcn:1.{h}"]
            assert list(request.peer_addresses) == ["fake:0.0,fake:0.1", "fake:1.0,fake:1.1"]


@pytest.mark.parametrize("host, fields, message", [
    (1, dict(hosts_per_pod=3), r"pod 1 host 1 \(fake:1.1\) runs with --hosts-per-pod 3, but --workers lists 2 hosts"),
    (0, dict(hosts_per_pod=1), r"pod 1 host 0 \(fake:1.0\) runs with --hosts-per-pod 1"),
    (1, dict(host_index=0), r"pod 1 host 0 \(fake:1.0\) and pod 1 host 1 \(fake:1.1\) both claim host index 0"),
    (1, dict(host_index=5), r"pod 1 host 1 \(fake:1.1\) runs with --host-index 5, out of range .* \(0..1\)"),
    (1, dict(pod_coordinator="elsewhere:1"),
     r"hosts of pod 1 disagree on the pod's coordinator.*pod 1 host 1 \(fake:1.1\) has 'elsewhere:1'"),
    (1, dict(local_devices=2), r"disagree on the device count per host: pod 1 host 1 \(fake:1.1\) has 2"),
    (1, dict(pod_index=0), r"pod 1 host 1 \(fake:1.1\) serves pod 0"),
])
def test_hosts_that_disagree_on_the_pods_layout_are_refused_naming_the_host(host, fields, message):
    pod = _pod(1)
    for key, value in fields.items():
        setattr(pod.hosts[host].status_reply, key, value)
    with pytest.raises(RunError, match=message):
        pod.status(1)


def test_hosts_listed_out_of_order_are_refused_naming_the_host():
    pod = PodClient(1, [FakeHost(1, 1), FakeHost(1, 0)])    # host 1's worker listed first
    with pytest.raises(RunError, match=r"pod 1 host 1 \(fake:1.1\) runs with --host-index 1, but --workers lists "
                                       r"it as host 0"):
        pod.status(1)


# ---- health -------------------------------------------------------------------------------------

def test_probe_is_the_worst_hosts_verdict_naming_the_host():
    assert _pod(1).probe(1).serving
    pod = PodClient(1, [FakeHost(1, 0), FakeHost(1, 1, probe=DEAD)])
    probe = pod.probe(1)
    assert probe.verdict is Verdict.DEAD and probe.detail == f"pod 1 host 1 (fake:1.1): {DEAD.detail}"
    pod = PodClient(1, [FakeHost(1, 0, probe=HUNG), FakeHost(1, 1, probe=DEAD)])
    probe = pod.probe(1)    # a hung host gets the pod killed and restarted: it counts first
    assert probe.verdict is Verdict.HUNG and probe.detail.startswith("pod 1 host 0 (fake:1.0): ")


# ---- --workers ----------------------------------------------------------------------------------

def test_workers_lists_pods_and_their_hosts():
    assert parse_workers("a:1,b:1") == [["a:1"], ["b:1"]]                 # one host per pod, as always
    assert parse_workers(" a:1 , b:1, ") == [["a:1"], ["b:1"]]
    assert parse_workers("a:1,b:1;c:1,d:1") == [["a:1", "b:1"], ["c:1", "d:1"]]
    assert parse_workers("a:1, b:1 ; c:1 ,d:1;") == [["a:1", "b:1"], ["c:1", "d:1"]]
    assert parse_workers("a:1;b:1") == [["a:1"], ["b:1"]]


def test_workers_from_a_hosts_file(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# pod 0\n10.0.0.1:50051, 10.0.0.2:50051\n\n10.0.1.1:50051 10.0.1.2:50051  # pod 1\n")
    assert parse_workers(f"@{hosts}") == [["10.0.0.1:50051", "10.0.0.2:50051"], ["10.0.1.1:50051", "10.0.1.2:50051"]]
    with pytest.raises(ConfigError, match="cannot read the hosts file"):
        parse_workers(f"@{tmp_path / 'missing.txt'}")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no worker addresses"):
        parse_workers(f"@{tmp_path / 'empty.txt'}")


@pytest.mark.parametrize("spec, message", [
    ("a:1,b:1;c:1", r"pod 1 lists 1 host\(s\) \(c:1\) but pod 0 lists 2 \(a:1, b:1\)"),
    ("a:1;b:1,c:1", r"pod 1 lists 2 host\(s\) \(b:1, c:1\) but pod 0 lists 1"),
    ("a:1,b:1;;c:1,d:1", r"pod 1 lists no hosts"),
    ("a:1,b:1;c:1,a:1", r"a:1 is listed twice: as pod 0 host 0 and as pod 1 host 1"),
    ("  ", "no worker addresses"),
])
def test_bad_workers_lists_are_refused_naming_the_pod(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_workers(spec)
    assert info.value.field == "--workers"


def test_unequal_host_counts_in_a_hosts_file_name_the_pod_and_the_file(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1 b:1\nc:1 d:1\ne:1\n")
    with pytest.raises(ConfigError, match=rf"pod 2 lists 1 host\(s\) \(e:1\) .* in {hosts}"):
        parse_workers(f"@{hosts}")


# ---- multipod local -----------------------------------------------------------------------------

@pytest.mark.parametrize("hosts, per_host, per_pod, devices", [
    (1, None, None, 2), (1, None, 4, 4), (1, 3, None, 3), (2, None, None, 2), (2, 2, None, 4), (2, None, 4, 4),
    (2, 1, 2, 2)])
def test_local_devices_per_pod(hosts, per_host, per_pod, devices):
    args = argparse.Namespace(hosts_per_pod=hosts, devices_per_host=per_host, devices_per_pod=per_pod)
    assert local_devices(args) == devices


@pytest.mark.parametrize("hosts, per_host, per_pod, message", [
    (2, 1, 4, r"--devices-per-pod: 4 is not --hosts-per-pod x --devices-per-host \(2 x 1 = 2\)"),
    (2, None, 3, r"--devices-per-pod: 3 devices do not split evenly over 2 hosts"),
    (0, None, None, r"--hosts-per-pod: must be >= 1"), (2, 0, None, r"--devices-per-host: must be >= 1")])
def test_local_device_flags_that_contradict_are_refused(hosts, per_host, per_pod, message):
    args = argparse.Namespace(hosts_per_pod=hosts, devices_per_host=per_host, devices_per_pod=per_pod)
    with pytest.raises(ConfigError, match=message):
        local_devices(args)


def test_local_pods_split_each_pods_devices_over_its_hosts(tmp_path):
    pods = LocalPods(2, 4, tmp_path, hosts_per_pod=2)
    assert pods.host_devices == [[2, 2], [2, 2]] and pods.device_counts == [4, 4]
    assert pods.log_path(1, 1) == tmp_path / "worker-1-host-1.log"
    assert LocalPods(2, [[1, 2], 2], tmp_path, hosts_per_pod=2).host_devices == [[1, 2], [1, 1]]
    assert LocalPods(2, 2, tmp_path).log_path(1) == tmp_path / "worker-1.log"
    with pytest.raises(ValueError, match="3 devices do not split evenly over 2 hosts"):
        LocalPods(1, 3, tmp_path, hosts_per_pod=2)


# A stand-in worker: holds its --listen port, writes the port files as a worker does, logs its argv.
FAKE_WORKER = r"""
import json, pathlib, socket, sys, time
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
host, port = opt("--listen").rsplit(":", 1)
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind((host, int(port)))
sock.listen()
print(json.dumps(args), flush=True)
port_file = pathlib.Path(opt("--port-file"))
pathlib.Path(f"{port_file}.dcn").write_text("tcp://" + opt("--dcn-listen").replace(":0", ":1"))
port_file.write_text(str(sock.getsockname()[1]))
time.sleep(600)
"""


class _FakeLocalPods(LocalPods):
    def command(self, pod, host, listen, port_file, dcn_listen):
        real = super().command(pod, host, listen, port_file, dcn_listen)
        return [sys.executable, "-c", FAKE_WORKER, *real[real.index("worker") + 1:]]


def _argv_lines(path: pathlib.Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("[")]
    return [dict(zip(argv[::2], argv[1::2])) for argv in
            ([a for a in line if a not in ("--exit-with-parent", "--insecure-no-auth")] for line in lines)]


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_local_pods_start_every_host_and_restart_a_pod_as_a_whole(tmp_path, capsys):
    with _FakeLocalPods(2, 2, tmp_path, hosts_per_pod=2, supervise=True, max_restarts=2,
                        security=Security()) as pods:
        assert len({a for hosts in pods.host_addresses for a in hosts}) == 4
        assert pods.addresses == [",".join(hosts) for hosts in pods.host_addresses]
        assert pods.workers == ";".join(pods.addresses) and parse_workers(pods.workers) == pods.host_addresses
        assert len(set(pods.coordinators)) == 2 and all(c.startswith("127.0.0.1:") for c in pods.coordinators)
        for p in range(2):
            for h in range(2):
                [argv] = _argv_lines(pods.log_path(p, h))
                assert (argv["--pod-index"], argv["--host-index"], argv["--hosts-per-pod"], argv["--devices"]) == (
                    str(p), str(h), "2", "1")
                assert argv["--pod-coordinator"] == pods.coordinators[p]
        before = [[proc.pid for proc in hosts] for hosts in pods.host_procs]
        addresses, coordinators = pods.host_addresses, list(pods.coordinators)

        pods.kill(1, host=1)            # one host dies: the whole pod starts again
        _wait_for(lambda: all(proc.pid not in before[1] and proc.poll() is None for proc in pods.host_procs[1])
                  and all(len(_argv_lines(pods.log_path(1, h))) == 2 for h in range(2)), "pod 1 was not restarted")
        assert [proc.pid for proc in pods.host_procs[0]] == before[0]      # pod 0 untouched
        assert pods.restarts == 1 and pods.host_addresses == addresses and pods.coordinators == coordinators
        for h in range(2):
            first, again = _argv_lines(pods.log_path(1, h))
            assert again["--listen"] == addresses[1][h] and again["--pod-coordinator"] == coordinators[1]
            assert again["--dcn-listen"] == first["--dcn-listen"].replace(":0", ":1")   # the port it had

        pods.kill(0)                    # kill(pod): every host of the pod
        _wait_for(lambda: all(proc.pid not in before[0] and proc.poll() is None for proc in pods.host_procs[0]),
                  "pod 0 was not restarted")
        assert pods.restarts == 2
    assert all(proc.poll() is not None for hosts in pods.host_procs for proc in hosts)
    err = capsys.readouterr().err
    assert "supervisor: pod 1 host 1 worker" in err and "other host(s) stopped: the pod restarts as a whole" in err


def test_a_one_host_pod_keeps_its_log_and_port_names(tmp_path):
    with _FakeLocalPods(2, 1, tmp_path, security=Security()) as pods:
        assert [len(hosts) for hosts in pods.host_addresses] == [1, 1] and pods.coordinators == ["", ""]
        assert pods.workers == ",".join(pods.addresses) and pods.procs == [h[0] for h in pods.host_procs]
        [argv] = _argv_lines(tmp_path / "worker-1.log")
        assert "--host-index" not in argv and "--pod-coordinator" not in argv


class _FinishesWhileLookedAt(FakeCall):
    """A host's call that finishes between the pod call's check and its choice of a call to wait
    on: done() says False `looks` times, then True (a race seen in a 2-host run)."""

    def __init__(self, looks: int):
        super().__init__(result="reply", pending=True)
        self._looks = looks

    def done(self) -> bool:
        if self._looks > 0:
            self._looks -= 1
            return False
        self.finish("reply")
        return True


def test_a_pod_call_whose_hosts_finish_while_it_looks_is_done_not_an_error():
    from multipod.controller.cluster.pod_client import PodCall
    call = PodCall(None, "Step", [FakeCall(result="reply"), _FinishesWhileLookedAt(looks=2)])
    assert call.wait(5.0) is True
    assert call.result() == "reply"


def test_workers_that_are_not_host_port_are_refused_naming_pod_and_host():
    with pytest.raises(ConfigError, match=r"--workers: pod 1 host 0: 'foo' is not HOST:PORT"):
        parse_workers("a:1,foo")
    with pytest.raises(ConfigError, match=r"--workers: pod 0 host 1: 'b:99999': the port must be a number"):
        parse_workers("a:1,b:99999;c:1,d:1")
