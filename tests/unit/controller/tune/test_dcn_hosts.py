"""`multipod tune --dcn` on pods of several hosts (controller/tune/dcn_session.py), against fake
workers: `--workers` with pods of two hosts is taken (no longer refused), every host of every pod
is asked for its data-plane address and probes with the same host of the other pods, the cost
model counts the pod's hosts (the streams' window cap, no DiLoCo unless
cost.DILOCO_ON_SEVERAL_HOSTS, and then no DiLoCo calibration run either), and --plan-out writes
the real hosts per pod. The training runs are faked too: the tests of what they measure are
test_dcn_tuner.py's. The workers' side: real worker servers of pods of two hosts, in this process,
probed by the tuner's own code."""
from __future__ import annotations

import pytest

from multipod.cli import build_parser
from multipod.controller.core.run_config import ConfigError, load_config
from multipod.controller.tune import cost, dcn_probe, dcn_session, dcn_trials
from multipod.controller.tune.dcn_probe import ComputeMeasurement, LinkMeasurement, LinkVariant
from multipod.controller.tune.dcn_tuner import Trial, calibrate, diloco_proposed, predict
from multipod.protos import multipod_pb2 as pb
from tests.helpers import TINY
from tests.unit.controller.tune.test_dcn_probe import FakeWorker

COMPUTE = ComputeMeasurement(step_s=0.035, compute_s=0.030, forward_s=0.010, overlapped_step_s=0.037)
WORKERS = "w0a:1,w0b:1;w1a:1,w1b:1"


def _args(*flags: str):
    return build_parser().parse_args(["tune", "--dcn", "--config", TINY, *flags])


def test_workers_with_pods_of_several_hosts_are_taken_and_checked_against_the_flags():
    addresses, pods, hosts = dcn_session.cluster_shape(_args("--workers", WORKERS))
    assert (addresses, pods, hosts) == ([["w0a:1", "w0b:1"], ["w1a:1", "w1b:1"]], 2, 2)
    assert dcn_session.cluster_shape(_args("--pods", "3", "--hosts-per-pod", "2")) == (None, 3, 2)
    assert dcn_session.cluster_shape(_args()) == (None, 2, 1)
    for flags, flag in ((("--workers", WORKERS, "--hosts-per-pod", "1"), "--hosts-per-pod"),
                        (("--workers", WORKERS, "--pods", "3"), "--pods"),
                        (("--workers", "a:1,b:1;c:1"), "--workers")):
        with pytest.raises(ConfigError) as caught:
            dcn_session.cluster_shape(_args(*flags))
        assert caught.value.field == flag, flags
    with pytest.raises(ConfigError) as caught:
        dcn_session.check_args(_args("--hosts-per-pod", "0"))
    assert caught.value.field == "--hosts-per-pod"


@pytest.mark.parametrize("overrides, hosts, devices, field", [
    ([], 2, 3, "--devices"), (["data.global_batch=6"], 2, 2, "data.global_batch"),
    (["mesh.model=2"], 2, 2, "mesh.model"),
])
def test_a_layout_that_does_not_split_over_the_hosts_is_refused_naming_the_field(overrides, hosts, devices, field):
    with pytest.raises(ConfigError) as caught:
        dcn_session.check_layout(load_config(TINY, overrides), 2, hosts, devices)
    assert caught.value.field == field
    dcn_session.check_layout(load_config(TINY), 2, 2, 4)      # 4 devices, 2 per host: fine


def test_the_cost_model_counts_the_pod_s_hosts():
    config = load_config(TINY, ["model.vocab_size=256"])
    # A long round trip: one stream's window (4 MiB per 200 ms) caps each host's link below its
    # 1 Gb/s. Two hosts have twice the streams, so the same gradient crosses in about half the time.
    slow_rtt = LinkMeasurement(100.0, (LinkVariant(1, 1 << 20, 1.0),))
    one, two = (calibrate(config, COMPUTE, slow_rtt, 2, 2, hosts_per_pod=k)[1] for k in (1, 2))
    assert (one.hosts_per_pod, two.hosts_per_pod, two.chips_per_pod) == (1, 2, 2)
    fused = [next(p for p in predict(config, COMPUTE, slow_rtt, 2, 2, diloco=False, hosts_per_pod=k)
                  if not p.choice.lossy and not p.choice.overlap and p.choice.streams == 1) for k in (1, 2)]
    latency = 0.1        # one round of 100 ms one way
    assert (fused[0].exchange_s - latency) == pytest.approx(2 * (fused[1].exchange_s - latency), rel=1e-6)
    assert fused[1].ici_s > 0       # the gather over the hosts is modelled (if at an ICI this fast)


@pytest.mark.parametrize("several", [False, True])
def test_diloco_is_proposed_on_several_hosts_only_as_the_cost_model_says(monkeypatch, several):
    monkeypatch.setattr(cost, "DILOCO_ON_SEVERAL_HOSTS", several)
    config = load_config(TINY, ["model.vocab_size=256"])
    link = LinkMeasurement(0.1, (LinkVariant(4, 1 << 20, 0.01),))
    assert diloco_proposed(1) and diloco_proposed(2) is several
    assert any(p.choice.sync.diloco for p in predict(config, COMPUTE, link, 2, 2, hosts_per_pod=1))
    assert any(p.choice.sync.diloco for p in predict(config, COMPUTE, link, 2, 2, hosts_per_pod=2)) is several


class FakeClient(FakeWorker):
    """A WorkerClient to one host of a pod (as dcn_session._measure_link makes them), on a link of
    0.05 Gb/s each way per host."""

    def __init__(self, pod_index: int, address: str, host_index: int | None = None):
        super().__init__(WORLD, 0.05)
        self.pod_index, self.host_index, self.address = pod_index, host_index, address
        self.name = f"pod {pod_index} host {host_index} ({address})"
        WORLD["clients"].append(self)

    def wait_serving(self, timeout_s: float) -> None:
        pass

    def status(self, timeout_s: float = 5.0) -> pb.StatusReply:
        return pb.StatusReply(dcn_address=f"curve://{self.address.replace(':1', '')}:9")

    def close(self) -> None:
        WORLD["closed"] += 1


WORLD: dict = {}


@pytest.mark.parametrize("several", [False, True])
def test_tune_dcn_runs_on_workers_of_two_hosts_per_pod(monkeypatch, tmp_path, capsys, several):
    WORLD.clear()
    WORLD.update(in_flight=0, most_at_once=0, encryption=[], probes=[], clients=[], closed=0)
    monkeypatch.setattr(cost, "DILOCO_ON_SEVERAL_HOSTS", several)
    monkeypatch.setattr("multipod.controller.cluster.client.WorkerClient", FakeClient)
    monkeypatch.setattr(dcn_probe, "measure_compute", lambda config, devices, *a, **k: COMPUTE)
    calibrated = []

    def run_calibration(config_path, overrides, choice, addresses, run_dir, steps, warmup):
        calibrated.append((choice, addresses))
        return dcn_trials.RunCalibration(choice, 0.060, 0.040, 0.007, 0.004, steps - warmup)

    def run_trial(config_path, overrides, projection, addresses, run_dir, steps, warmup, loss_at=None):
        return Trial(projection, projection.step_s, 2.0)
    monkeypatch.setattr(dcn_trials, "run_calibration", run_calibration)
    monkeypatch.setattr(dcn_trials, "run_trial", run_trial)
    plan = tmp_path / "plan.toml"
    args = _args("--workers", WORKERS, "--devices", "2", "--streams", "1", "--chunk-bytes", "1MiB",
                 "--compressions", "none", "--probe-rounds", "1", "--run-exact", "1", "--run-lossy", "1",
                 "--out", str(tmp_path / "tuned.toml"), "--plan-out", str(plan))
    assert dcn_session.main(args) == 0
    printed = capsys.readouterr().out
    # Every host asked for its data-plane address, then probed with host h of the other pod.
    assert sorted((c.pod_index, c.host_index) for c in WORLD["clients"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert WORLD["closed"] == 4
    for client, request in WORLD["probes"]:
        if not request.measure_encryption:
            host = "ab"[client.host_index]
            assert list(request.dcn_addresses) == [f"curve://w0{host}:9", f"curve://w1{host}:9"]
    assert "2 pods of 2 host(s) sharing 2 device(s)" in printed and "0.100 Gb/s each way per pod" in printed
    # The calibration runs trained on every host of every pod; DiLoCo's only where proposed.
    assert all(addresses == [["w0a:1", "w0b:1"], ["w1a:1", "w1b:1"]] for _, addresses in calibrated)
    assert [c.sync.diloco for c, _ in calibrated] == [False, False] + ([True] if several else [])
    assert ("no DiLoCo candidates" in printed) is not several
    assert ("calibrated, DiLoCo inner step" in printed) is several
    assert "0.100 Gb/s each way per pod (its 2 hosts at once) at best" in printed
    assert "--hosts-per-pod 2 --devices-per-pod 2" in printed
    written = plan.read_text()
    assert "hosts_per_pod = 2" in written and "chips_per_pod = 2" in written


@pytest.fixture(scope="module")
def two_host_pods():
    """2 pods of 2 hosts as real worker servers in this process: each host with its HostLayout and
    data-plane listener, without the pod's jax.distributed cluster (ProbeLink does not use it)."""
    from multipod.pod_worker.hosts import HostLayout
    from multipod.pod_worker.server import start_server
    from multipod.protos.channels import Security, default_security, set_default_security
    before = default_security()
    set_default_security(Security())
    started = [[start_server(pod, "127.0.0.1:0", Security(),
                             layout=HostLayout(host_index=h, hosts_per_pod=2, coordinator=f"127.0.0.1:{pod + 1}"))
                for h in range(2)] for pod in range(2)]
    yield started
    for server, service, _, _ in (s for pod in started for s in pod):
        server.stop(0)
        service.pod.close()
    set_default_security(before)


def test_the_workers_of_pods_of_two_hosts_probe_host_to_host_over_their_data_planes(two_host_pods, capsys):
    addresses = [[f"127.0.0.1:{port}" for _, _, _, port in pod] for pod in two_host_pods]
    args = _args("--streams", "1", "--chunk-bytes", "1MiB", "--compressions", "none", "--probe-rounds", "2")
    dcn_session.check_args(args)
    link = dcn_session._measure_link(args, addresses, 2 * (1 << 20), timeout_s=30, say=print)
    printed = capsys.readouterr().out
    assert link.measured and link.hosts_per_pod == 2 and link.encrypted is False
    assert link.probe_bytes == 4 << 20          # each host's block, at least the probe's minimum
    assert len(link.host_gbps) == 2 and all(g > 0 for g in link.host_gbps)
    (variant,) = link.variants
    assert variant.gbps == pytest.approx(2 * min(link.host_gbps), rel=1e-6)
    enc = link.encryption
    assert enc is not None and [(h.pod, h.host_index) for h in enc.hosts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "all 2 hosts of each pod at once" in printed
    # No host keeps a prepared probe holding its listener: every probe that was prepared also ran.
    assert all(service.pod._probe is None for pod in two_host_pods for _, service, _, _ in pod)
