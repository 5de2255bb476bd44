"""`multipod tune --dcn`'s link measurement (controller/tune/dcn_probe.py measure_link, LinkProber)
against fake workers: what encryption costs comes from every pod's own loopback rates, asked one
pod after another, and goes into LinkMeasurement, the printed report and the JSON; a worker that
cannot time it leaves the link figures standing. On pods of several hosts, host h of every pod
probes with host h of the others, every host at once, and the pod's rate is its hosts' together."""
from __future__ import annotations

import json

import grpc
import pytest

from multipod.controller.cluster.client import WorkerError
from multipod.controller.tune import dcn_report
from multipod.controller.tune.dcn_probe import (
    ComputeMeasurement,
    EncryptionMeasurement,
    HostCipherRate,
    LinkProber,
    measure_link,
)
from multipod.model.config import ConfigError
from multipod.protos import multipod_pb2 as pb

MIB = 1 << 20
COMPUTE = ComputeMeasurement(step_s=0.035, compute_s=0.030, forward_s=0.010, overlapped_step_s=None)


class _Done:
    def __init__(self, client, reply):
        self.client, self.reply = client, reply

    def result(self):
        self.client.world["in_flight"] -= 1
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def cancel(self):
        pass


class FakeWorker:
    """A pod's worker whose link moves `gbps` each way after 1 ms, and whose host's data plane
    moves `curve` and `plain` bytes/s over loopback (or fails with `fail`)."""

    def __init__(self, world: dict, gbps: float, curve: float = 5e8, plain: float = 2e9, encrypted: bool = True,
                 fail: Exception | None = None):
        self.world, self.gbps, self.curve, self.plain, self.encrypted, self.fail = \
            world, gbps, curve, plain, encrypted, fail

    def probe_link_async(self, request: pb.ProbeLinkRequest, timeout_s: float) -> _Done:
        self.world["in_flight"] += 1
        self.world["probes"].append((self, request))
        if request.measure_encryption:
            self.world["encryption"].append((request.pod_index, request.chunk_bytes, request.encryption_seconds))
            self.world["most_at_once"] = max(self.world["most_at_once"], self.world["in_flight"])
            reply = self.fail or pb.ProbeLinkReply(encrypted=self.encrypted, curve_bytes_per_s=self.curve,
                                                   plain_bytes_per_s=self.plain)
            return _Done(self, reply)
        self.world["most_probing"] = max(self.world.get("most_probing", 0), self.world["in_flight"])
        seconds = 0.001 + request.bytes * 8 / (self.gbps * 1e9) if not request.prepare else None
        return _Done(self, pb.ProbeLinkReply(seconds=[seconds] * request.rounds if seconds else [],
                                             encrypted=self.encrypted))


def _world() -> dict:
    return {"in_flight": 0, "most_at_once": 0, "encryption": [], "probes": []}


def _prober(world, gbps: float, **worker) -> LinkProber:
    clients = [[FakeWorker(world, gbps, **worker)] for _ in range(2)]
    return LinkProber(clients, [["curve://10.0.0.1:5000"], ["curve://10.0.0.2:5000"]], rounds=2, timeout_s=10)


def test_encryption_is_timed_on_every_pod_host_in_turn_and_costs_nothing_on_a_slow_link(tmp_path, capsys):
    world, said = _world(), []
    link = measure_link(_prober(world, 0.1), 8 * MIB, [1, 2], [MIB, 4 * MIB], [], said.append)
    enc = link.encryption
    assert enc is not None
    best = max(link.variants, key=lambda v: v.gbps)
    # Every pod, one after another, at the best variant's chunk size.
    assert [pod for pod, _, _ in world["encryption"]] == [0, 1] and world["most_at_once"] == 1
    assert {chunk for _, chunk, _ in world["encryption"]} == {best.chunk_bytes} == {enc.chunk_bytes}
    assert all(0 < seconds <= 1 for _, _, seconds in world["encryption"])
    assert enc.hosts == (HostCipherRate(0, "10.0.0.1", 5e8, 2e9), HostCipherRate(1, "10.0.0.2", 5e8, 2e9))
    assert enc.ceiling_gbps == 4.0 and enc.link_gbps == best.gbps and enc.link_encrypted and not enc.bound
    line = next(s for s in said if "encryption:" in s)
    assert "costs nothing" in line and "above 4.00 Gb/s" in line and "10.0.0.2" in line

    dcn_report.print_report(link, COMPUTE, [], [], None, allow_lossy=False)
    printed = capsys.readouterr().out
    assert "CURVE moves pod 0 (10.0.0.1) 0.50 GB/s, plain 2.00 GB/s" in printed and "costs nothing" in printed
    dcn_report.write_json(tmp_path / "report.json", link, COMPUTE, [], [], None)
    written = json.loads((tmp_path / "report.json").read_text())["link"]["encryption"]
    assert written["ceiling_gbps"] == 4.0 and written["bound"] is False
    assert written["hosts"][1] == {"pod": 1, "host": "10.0.0.2", "curve_bytes_per_s": 5e8, "plain_bytes_per_s": 2e9,
                                   "host_index": 0}


def test_an_encrypted_link_near_the_curve_ceiling_is_reported_bound_by_encryption():
    said: list = []
    link = measure_link(_prober(_world(), 3.5), 8 * MIB, [1], [MIB], [], said.append)
    assert link.encryption is not None and link.encryption.bound
    assert "bound by encryption" in next(s for s in said if "encryption:" in s)
    # The same rate unencrypted is not bound, but would be with CURVE.
    plain = EncryptionMeasurement.of(link.encryption.hosts, MIB, 3.5, encrypted=False)
    assert not plain.bound
    assert "would be bound by encryption with dcn.encrypt" in dcn_report.encryption_summary(plain)


def test_the_slowest_host_sets_the_ceiling():
    hosts = (HostCipherRate(0, "a", 1e9, 3e9), HostCipherRate(1, "b", 2.5e8, 3e9))
    assert EncryptionMeasurement.of(hosts, MIB, 0.1, True).ceiling_gbps == 2.0


def test_a_worker_that_cannot_time_its_data_plane_leaves_the_link_figures_standing():
    for fail, curve in ((WorkerError("pod 0: FAILED_PRECONDITION", grpc.StatusCode.FAILED_PRECONDITION), 5e8),
                        (None, 0.0)):
        said: list = []
        link = measure_link(_prober(_world(), 0.1, fail=fail, curve=curve), 8 * MIB, [1], [MIB], [], said.append)
        assert link.encryption is None and link.variants and link.encrypted
        assert any("encryption: not measured" in s and "pod 0" in s for s in said)


def _two_host_pods(world, host_gbps: tuple[float, float], curve=(5e8, 4e8)) -> LinkProber:
    """2 pods of 2 hosts; host h's links move host_gbps[h] each way, its data plane curve[h] bytes/s."""
    clients = [[FakeWorker(world, host_gbps[h], curve=curve[h]) for h in range(2)] for _ in range(2)]
    for pod, hosts in enumerate(clients):
        for h, worker in enumerate(hosts):
            worker.name = f"p{pod}h{h}"
    dcn = [[f"curve://10.0.{pod}.{h + 1}:5000" for h in range(2)] for pod in range(2)]
    return LinkProber(clients, dcn, rounds=2, timeout_s=10)


def test_every_host_of_a_pod_probes_with_the_same_host_of_the_others_at_once_and_the_rates_add_up():
    world, said = _world(), []
    link = measure_link(_two_host_pods(world, (0.05, 0.05)), 8 * MIB, [1, 2], [MIB], ["int8"], said.append)
    timed = [(w.name, r) for w, r in world["probes"] if not r.measure_encryption]
    # Host h of every pod, with host h's data-plane address of every pod as its peers.
    for name, request in timed:
        host = int(name[-1])
        assert list(request.dcn_addresses) == [f"curve://10.0.0.{host + 1}:5000", f"curve://10.0.1.{host + 1}:5000"]
        assert request.pod_index == int(name[1])
    # Every round of every variant: all 4 hosts asked at once, prepared first, then timed.
    assert world["most_probing"] == 4
    assert {name for name, _ in timed} == {"p0h0", "p0h1", "p1h0", "p1h1"}
    assert all(r.bytes == 8 * MIB for _, r in timed if r.bytes != 4096)
    # Each host moves 0.05 Gb/s of its own block: the pod moves 0.1 (the sum over its hosts).
    assert link.hosts_per_pod == 2 and link.probe_bytes == 8 * MIB
    for variant in link.variants:
        assert variant.gbps == pytest.approx(0.1, rel=1e-3)
    assert link.host_gbps == pytest.approx((0.05, 0.05), rel=1e-3)
    # int8 takes the fakes as long as raw bytes: bound by the hosts, at the pod's values (both
    # hosts' blocks) over the round's time beyond the latency round's.
    work = (8 * MIB - 4096) * 8 / 0.05e9
    assert link.host_values_per_s["int8"] == pytest.approx(2 * 8 * MIB / 4 / work, rel=1e-6)
    assert any("2 hosts of each pod at once" in s and "per pod (hosts 0.050, 0.050)" in s for s in said)
    # What encryption costs: every host of every pod in turn; the pod's ceiling is its hosts x the slowest.
    enc = link.encryption
    assert enc is not None and world["most_at_once"] == 1
    assert [(h.pod, h.host_index, h.host) for h in enc.hosts] == \
        [(0, 0, "10.0.0.1"), (0, 1, "10.0.0.2"), (1, 0, "10.0.1.1"), (1, 1, "10.0.1.2")]
    assert enc.hosts_per_pod == 2 and enc.ceiling_gbps == pytest.approx(2 * 4e8 * 8 / 1e9)
    line = next(s for s in said if "encryption:" in s)
    assert "pod 1 host 1 (10.0.1.2) 0.40 GB/s" in line and "its 2 hosts x the slowest host's" in line


def test_the_slowest_host_sets_a_pod_s_rate():
    # Host 0 at 0.2 Gb/s, host 1 at 0.05: a pod's exchange ends with its slower host's block, so
    # the pod moves 2 x 0.05 Gb/s, not 0.25.
    link = measure_link(_two_host_pods(_world(), (0.2, 0.05)), 8 * MIB, [1], [MIB], [], lambda _: None)
    assert link.variants[0].gbps == pytest.approx(0.1, rel=1e-2)
    assert link.host_gbps[0] > 3 * link.host_gbps[1]


def test_a_prober_of_pods_with_different_hosts_is_refused():
    world = _world()
    with pytest.raises(ConfigError) as caught:
        LinkProber([[FakeWorker(world, 1.0)], [FakeWorker(world, 1.0)] * 2], [["a"], ["b", "c"]], 2, 10)
    assert caught.value.field == "link"
