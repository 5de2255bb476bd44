"""What `multipod tune --dcn` measures before it predicts: the link between the pods, on their
data plane, and one pod's compute, with `multipod tune`'s layout probe.

The link (measure_link): every host of every pod is asked at once to ProbeLink (pod_worker/
link_probe.py: rounds of the Exchange a run uses, under the probe's own run id). Host h of every pod
exchanges with host h of the other pods, as in a run on pods of several hosts (pod_worker/hosts.py:
host h sends only block h of the gradient), all hosts at the same time, so that hosts sharing a link
(a pod's uplink, --netns's shaped one) share it as in a run. A round's seconds are, for each host
index, the median over every pod's rounds of that host, and the pod's are its slowest host's (a
pod's exchange ends when its last host's block is in). From those seconds:
  latency     a round of 4 KiB per host with one stream: what one exchange round costs beyond its
              bytes (the cost model's `rounds x dcn_latency_ms`);
  rate        for each (streams, chunk size) tried, a round of `size` bytes per host (raw float32):
              hosts x size / (seconds - latency), as Gb/s each way: one pod's rate, the sum over its
              hosts' links as its slowest host sets it (per-host rate x hosts); cost_inputs.Links.dcn_gbps;
  host rate   for each compression tried, with the most streams and the largest chunk: if a round
              takes longer than its bytes at the raw rate would, the values per second the pod's
              hosts together encode, decode and sum it at (cost_inputs.Calibration.host_values_per_s),
              else nothing.
The reply says whether the data plane is CURVE-encrypted; every figure is of the link as it is.
  encryption  what CURVE costs, apart from the link (which the tuner cannot probe unencrypted:
              workers beyond loopback refuse to listen without CURVE unless --insecure): every
              host of every pod in turn (hosts sharing a machine would measure each other) times its
              own data plane over loopback, with CURVE and without, at the best variant's chunk size
              (pod_worker/dcn/curve_rate.py). A host's CURVE rate bounds its streams together (they
              share one ZeroMQ I/O thread per side), and a pod's hosts encrypt their blocks side by
              side: the ceiling of a pod's encrypted exchange is its hosts x the slowest host's rate;
              an encrypted link measured at BOUND_FRACTION of it or more is bound by encryption.
Given --link-gbps (and --latency-ms), nothing is measured: those values stand for every variant.

The compute (measure_compute): the run's layout in the layout probe (controller/tune/runner.py), its
step without an exchange (compute, update, checksum) and its forward pass alone; with dcn.overlap on
too, so the overlapped step's extra cost is measured rather than assumed. `repeats` probes run one
after another (never at once: concurrent probes on shared cores measured each other, the plain
step 23 and 31 ms in one session where the overlapped one, probed after them, took 11-14 ms), and
each figure is the median over them. What one pod costs while the other pods compute at the same
time is not this probe's: the calibration run measures it (controller/tune/dcn_trials.py). A pod of
several hosts is probed as one process with all of its devices (the probe cannot cheaply start K
processes of one jax.distributed cluster): the same mesh and program without the hosts' collectives
and the gather of the summed blocks, which the calibration runs, on the real pods, do contain.
"""
from __future__ import annotations

import dataclasses
import statistics
import uuid
from dataclasses import dataclass, field

from multipod.model.config import ConfigError

LATENCY_BYTES = 4096
MIB = 1 << 20
ENCRYPTION_SECONDS = 0.2    # per rate and host: two of them, ~0.5 s per worker with setup
BOUND_FRACTION = 0.7        # near the CURVE ceiling: the ceiling, not the wire, sets the link figures


@dataclass(frozen=True)
class LinkVariant:
    """One data-plane setting the link was measured (or given) at."""
    streams: int
    chunk_bytes: int
    gbps: float                 # each way, per pod


@dataclass(frozen=True)
class HostCipherRate:
    """One host of a pod: the rate its data plane moves over loopback, CURVE-encrypted and plain
    (`host` its data-plane address's host, `host_index` its place in the pod)."""
    pod: int
    host: str
    curve_bytes_per_s: float
    plain_bytes_per_s: float
    host_index: int = 0


@dataclass(frozen=True)
class EncryptionMeasurement:
    """What CURVE costs (module docstring), against the link as measured."""
    chunk_bytes: int
    hosts: tuple[HostCipherRate, ...]
    ceiling_gbps: float         # a pod's encrypted exchange, every stream together: its hosts x the slowest host's
    #                             CURVE rate (its hosts send their blocks side by side)
    link_gbps: float            # the best rate the link was measured at (one pod's, every host together)
    link_encrypted: bool        # that rate is of a CURVE-encrypted link
    bound: bool                 # encrypted, and at BOUND_FRACTION of the ceiling or more
    hosts_per_pod: int = 1

    @classmethod
    def of(cls, hosts: tuple[HostCipherRate, ...], chunk_bytes: int, link_gbps: float, encrypted: bool
           ) -> EncryptionMeasurement:
        per_pod = 1 + max(h.host_index for h in hosts)
        ceiling = per_pod * min(h.curve_bytes_per_s for h in hosts) * 8 / 1e9
        return cls(chunk_bytes, hosts, ceiling, link_gbps, encrypted,
                   encrypted and link_gbps >= BOUND_FRACTION * ceiling, per_pod)


@dataclass(frozen=True)
class LinkMeasurement:
    latency_ms: float           # per exchange round
    variants: tuple[LinkVariant, ...]
    host_values_per_s: dict = field(default_factory=dict)    # compression value -> values/s (a pod's hosts)
    encrypted: bool | None = None       # None: not measured (given values)
    measured: bool = True
    probe_bytes: int = 0                # a throughput round's bytes, per host
    encryption: EncryptionMeasurement | None = None     # None: not measured
    hosts_per_pod: int = 1              # hosts of a pod probed at once (the rates are the pod's)
    host_gbps: tuple[float, ...] = ()   # the best variant's rate of each host index (measured only)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def given_link(gbps: float | None, latency_ms: float | None, streams: list[int], chunk_bytes: list[int]
               ) -> LinkMeasurement:
    """--link-gbps and --latency-ms as given (ConfigError naming the flag if not usable)."""
    from multipod.controller.tune.cost_inputs import check_number
    check_number("--link-gbps", gbps)
    assert gbps is not None
    latency_ms = 0.0 if latency_ms is None else latency_ms
    check_number("--latency-ms", latency_ms, strict=False)
    return LinkMeasurement(latency_ms, tuple(LinkVariant(s, c, gbps) for s in streams for c in chunk_bytes),
                           measured=False)


class LinkProber:
    """ProbeLink calls to every host of every pod at once (module docstring): clients[pod][host]
    (one WorkerClient per host) and dcn_addresses[pod][host] their data-plane addresses; every pod
    has the same number of hosts."""

    def __init__(self, clients: list[list], dcn_addresses: list[list[str]], rounds: int, timeout_s: float):
        shapes = {(len(hosts), len(dcn)) for hosts, dcn in zip(clients, dcn_addresses)}
        if not clients or not clients[0] or len(dcn_addresses) != len(clients) or \
                shapes != {(len(clients[0]), len(clients[0]))}:
            raise ConfigError("link", f"every pod needs as many hosts as the others, each with a data-plane "
                                      f"address: {dcn_addresses}")
        self.clients, self.dcn, self.rounds, self.timeout_s = clients, dcn_addresses, rounds, timeout_s
        self.hosts = len(clients[0])
        self.encrypted: bool | None = None
        self.host_seconds: tuple[float, ...] = ()    # the last round's, per host index (seconds())

    def seconds(self, nbytes: int, streams: int, chunk_bytes: int, compression: str = "none") -> float:
        """One pod's round of `nbytes` per host: for each host index the median over every pod's
        rounds of that host (each host times the same rounds with its peers), the slowest of them."""
        from multipod import protos
        from multipod.controller.cluster.client import WorkerError
        from multipod.protos import multipod_pb2 as pb
        run_id = f"link-probe-{uuid.uuid4().hex[:12]}"

        def start(prepare: bool) -> list:
            # Host h of every pod probes with host h of the others: its peers are their hosts h.
            return [[client.probe_link_async(pb.ProbeLinkRequest(
                protocol_version=protos.PROTOCOL_VERSION, run_id=run_id, pod_index=pod,
                dcn_addresses=[dcn[host] for dcn in self.dcn], bytes=nbytes, streams=streams, chunk_bytes=chunk_bytes,
                rounds=self.rounds, compression=compression, prepare=prepare), self.timeout_s)
                for host, client in enumerate(hosts)] for pod, hosts in enumerate(self.clients)]
        calls: list = []
        try:
            calls = start(prepare=True)      # every host's exchange exists before any host sends
            for call in (c for hosts in calls for c in hosts):
                call.result()
            calls = start(prepare=False)
            replies = [[call.result() for call in hosts] for hosts in calls]
        except WorkerError as exc:
            for call in (c for hosts in calls for c in hosts):
                call.cancel()
            raise ConfigError("link", f"no reachable link between the pods' data planes ({self.dcn}): {exc}") from None
        self.encrypted = all(r.encrypted for hosts in replies for r in hosts)
        self.host_seconds = tuple(statistics.median(s for hosts in replies for s in hosts[h].seconds)
                                  for h in range(self.hosts))
        return max(self.host_seconds)

    def cipher_rates(self, chunk_bytes: int, seconds: float = ENCRYPTION_SECONDS) -> tuple[HostCipherRate, ...]:
        """Every pod's every host's data-plane rate over loopback, CURVE and plain, one host after
        another; ConfigError("link") naming the host if one fails."""
        from multipod import protos
        from multipod.controller.cluster.client import WorkerError
        from multipod.protos import multipod_pb2 as pb
        rates = []
        for pod, hosts in enumerate(self.clients):
            for index, client in enumerate(hosts):
                who = f"pod {pod}" if self.hosts == 1 else f"pod {pod} host {index}"
                request = pb.ProbeLinkRequest(protocol_version=protos.PROTOCOL_VERSION, pod_index=pod,
                                              chunk_bytes=chunk_bytes, measure_encryption=True,
                                              encryption_seconds=seconds)
                try:
                    reply = client.probe_link_async(request, self.timeout_s).result()
                except WorkerError as exc:
                    raise ConfigError("link", f"{who} could not time its data plane with and without CURVE: "
                                              f"{exc}") from None
                if not all(0 < r < float("inf") for r in (reply.curve_bytes_per_s, reply.plain_bytes_per_s)):
                    raise ConfigError("link", f"{who} timed its data plane at no usable rate: CURVE "
                                              f"{reply.curve_bytes_per_s}, plain {reply.plain_bytes_per_s} bytes/s")
                address = self.dcn[pod][index]
                host = address.partition("://")[2].rpartition(":")[0] or address
                rates.append(HostCipherRate(pod, host, reply.curve_bytes_per_s, reply.plain_bytes_per_s, index))
        return tuple(rates)


def measure_link(prober: LinkProber, size: int, streams: list[int], chunk_bytes: list[int], compressions: list[str],
                 say=print) -> LinkMeasurement:
    """Latency, the rate at every (streams, chunk) and the host rate of every compression, as the
    module docstring says, with `size` bytes per host; ConfigError("link") if no round gets through."""
    from multipod.controller.tune.cost import bytes_per_value
    size = max(4, size - size % 4)
    hosts = prober.hosts
    per_host = f" per host, {hosts} hosts of each pod at once" if hosts > 1 else ""
    latency = prober.seconds(LATENCY_BYTES, 1, MIB)
    say(f"  latency: {latency * 1e3:.2f} ms per exchange round ({LATENCY_BYTES} bytes{per_host}, 1 stream)")
    variants, host_gbps = [], {}
    for s in streams:
        for chunk in chunk_bytes:
            t = prober.seconds(size, s, chunk)
            gbps = hosts * size * 8 / max(t - latency, 1e-9) / 1e9
            variants.append(LinkVariant(s, chunk, gbps))
            host_gbps[s, chunk] = tuple(size * 8 / max(h - latency, 1e-9) / 1e9 for h in prober.host_seconds)
            each = "" if hosts == 1 else " (hosts " + ", ".join(f"{g:.3f}" for g in host_gbps[s, chunk]) + ")"
            say(f"  {size / MIB:.1f} MiB{per_host}, {s} stream(s), {chunk / MIB:g} MiB chunks: {t * 1e3:.1f} ms "
                f"-> {gbps:.3f} Gb/s each way{' per pod' if hosts > 1 else ''}{each}")
    best = max(variants, key=lambda v: v.gbps)
    host: dict = {}
    for compression in compressions:
        t = prober.seconds(size, best.streams, best.chunk_bytes, compression)
        values = hosts * size / 4       # the pod's, every host's block together
        on_wire = values * bytes_per_value(compression) * 8 / (best.gbps * 1e9)
        work = t - latency
        note = "bound by the link"
        if work > on_wire * 1.05:
            host[compression] = values / work
            note = f"bound by the hosts: {values / work / 1e6:.1f} M values/s"
        say(f"  {size / MIB:.1f} MiB{per_host} as {compression}: {t * 1e3:.1f} ms ({note})")
    encryption = None
    try:
        encryption = EncryptionMeasurement.of(prober.cipher_rates(best.chunk_bytes), best.chunk_bytes, best.gbps,
                                              bool(prober.encrypted))
        say(f"  {encryption_summary(encryption)}")
    except ConfigError as exc:      # the link figures stand without it
        say(f"  encryption: not measured ({exc})")
    return LinkMeasurement(latency * 1e3, tuple(variants), host, prober.encrypted, True, size, encryption, hosts,
                           host_gbps[best.streams, best.chunk_bytes])


def encryption_summary(encryption: EncryptionMeasurement) -> str:
    """One line: every host's CURVE and plain rate, and what CURVE costs at the measured link rate."""
    several = encryption.hosts_per_pod > 1
    hosts = "; ".join(f"pod {h.pod}{f' host {h.host_index}' if several else ''} ({h.host}) "
                      f"{h.curve_bytes_per_s / 1e9:.2f} GB/s, plain "
                      f"{h.plain_bytes_per_s / 1e9:.2f} GB/s" for h in encryption.hosts)
    ceiling, link = encryption.ceiling_gbps, encryption.link_gbps
    together = "all streams" if not several else \
        f"all streams; a pod's ceiling is its {encryption.hosts_per_pod} hosts x the slowest host's"
    head = f"encryption: CURVE moves {hosts} over loopback ({encryption.chunk_bytes / MIB:g} MiB frames, {together})"
    if encryption.bound:
        return (f"{head}: the link figures are bound by encryption ({link:.3f} Gb/s measured against a CURVE "
                f"ceiling of {ceiling:.2f} Gb/s); the wire itself may be faster")
    share = link / ceiling
    if share >= BOUND_FRACTION:     # and unencrypted
        return (f"{head}: this unencrypted {link:.3f} Gb/s link would be bound by encryption with dcn.encrypt "
                f"(a CURVE ceiling of {ceiling:.2f} Gb/s)")
    what = "this" if encryption.link_encrypted else "this unencrypted"
    cost = "costs nothing" if share < 0.5 else "does not bound the exchange yet"
    return (f"{head}: at {what} {link:.3f} Gb/s link it {cost} ({share:.0%} of its ceiling); at a line rate "
            f"above {ceiling:.2f} Gb/s it would bound the exchange")


@dataclass(frozen=True)
class ComputeMeasurement:
    """One pod's step for the run's layout, without an exchange (seconds, medians)."""
    step_s: float               # compute + update + checksum (the layout probe's step)
    compute_s: float            # forward + backward
    forward_s: float
    overlapped_step_s: float | None     # the same step with dcn.overlap on (None: not measured)

    @property
    def backward_s(self) -> float:
        return max(self.compute_s - self.forward_s, 0.0)

    @property
    def update_s(self) -> float:
        return max(self.step_s - self.compute_s, 0.0)


def measure_compute(config, devices: int, per_pod_batch: int, steps: int, timeout_s: float, repeats: int = 1,
                    overlap: bool = True) -> ComputeMeasurement:
    """The layout probe on the run's layout (and with dcn.overlap on), `repeats` probes one after
    another, each figure the median over them; ConfigError("--config") if the layout does not run.
    devices: the pod's, all its hosts' together, in one process (module docstring)."""
    from multipod.controller.tune.grid import Candidate
    from multipod.controller.tune.runner import run_candidates
    from multipod.pod_worker.schema import Overlap
    candidate = Candidate(config.mesh.data, config.mesh.model, config.model.sequence_parallel,
                          config.model.microbatches, config.model.remat)
    configs = [dataclasses.replace(config, dcn=dataclasses.replace(config.dcn, overlap=Overlap.OFF))]
    if overlap:
        configs.append(dataclasses.replace(config, dcn=dataclasses.replace(config.dcn, overlap=Overlap.ON)))
    payloads = [c.worker_config().to_json() for c in configs]
    spec = {"devices": devices, "per_pod_batch": per_pod_batch, "steps": steps, "memory_limit": None,
            "forward": True}
    rows = []
    for _ in range(max(1, repeats)):
        found = run_candidates([candidate] * len(payloads), payloads, spec, timeout_s)[0]
        if found is None:
            raise ConfigError("--config", "the layout probe did not report (see the errors above)")
        for row in found:
            if row.get("status") != "ok":
                raise ConfigError("--config", f"the run's layout {candidate.label()} does not run: "
                                              f"{row.get('error', row.get('status'))}")
        rows.append(found)
    fused = [rs[0] for rs in rows]
    overlapped = statistics.median(rs[1]["step_time_s"] for rs in rows) if overlap else None
    return ComputeMeasurement(statistics.median(r["step_time_s"] for r in fused),
                              statistics.median(r["step_parts_s"]["compute_s"] for r in fused),
                              statistics.median(r["forward_s"] for r in fused), overlapped)
