"""`multipod tune --dcn`'s link measurement (controller/tune/dcn_probe.py measure_link, LinkProber)
against fake workers: what encryption costs comes from every pod's own loopback rates, asked one
pod after another, and goes into LinkMeasurement, the printed report and the JSON; a worker that
cannot time it leaves the link figures standing."""
from __future__ import annotations

import json

import grpc

from multipod.controller.cluster.client import WorkerError
from multipod.controller.tune import dcn_report
from multipod.controller.tune.dcn_probe import (
    ComputeMeasurement,
    EncryptionMeasurement,
    HostCipherRate,
    LinkProber,
    measure_link,
)
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
        if request.measure_encryption:
            self.world["encryption"].append((request.pod_index, request.chunk_bytes, request.encryption_seconds))
            self.world["most_at_once"] = max(self.world["most_at_once"], self.world["in_flight"])
            reply = self.fail or pb.ProbeLinkReply(encrypted=self.encrypted, curve_bytes_per_s=self.curve,
                                                   plain_bytes_per_s=self.plain)
            return _Done(self, reply)
        seconds = 0.001 + request.bytes * 8 / (self.gbps * 1e9) if not request.prepare else None
        return _Done(self, pb.ProbeLinkReply(seconds=[seconds] * request.rounds if seconds else [],
                                             encrypted=self.encrypted))


def _world() -> dict:
    return {"in_flight": 0, "most_at_once": 0, "encryption": []}


def _prober(world, gbps: float, **worker) -> LinkProber:
    clients = [FakeWorker(world, gbps, **worker) for _ in range(2)]
    return LinkProber(clients, ["curve://10.0.0.1:5000", "curve://10.0.0.2:5000"], rounds=2, timeout_s=10)


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
    assert written["hosts"][1] == {"pod": 1, "host": "10.0.0.2", "curve_bytes_per_s": 5e8, "plain_bytes_per_s": 2e9}


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
