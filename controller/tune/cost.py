"""The cost model of the cross-pod sync: what one training step costs for a model, a layout, a
chip, the links and a sync choice. Pure Python (no jax, no numpy): `multipod plan` projects with it
on paper; `multipod tune --dcn` is to rank its candidates with it before it measures the best few.

One pod's compute, from the model's FLOPs (model/config.py: 6N + 12·L·H·Q·T per token, PaLM
appendix B) at an expected MFU:
    C = tokens per pod x FLOPs per token / (chips per pod x peak x MFU)
    forward = C / (1 + r), backward = C - forward, with r = Calibration.backward_ratio (2).
The DCN bytes one pod sends per exchange, as pod_worker/dcn/collectives.py moves them: 2 pods send
each other the whole gradient (WholeGradient, one round); N > 2 pods reduce-scatter then all-gather
(ReduceScatterAllGather, two rounds), 2(N-1)/N of it. A value takes bytes_per_value() on the wire
(pod_worker/dcn/wire.py): its own bytes, bf16 2, int8 1 + 4/256, int4 1/2 + 4/256 (a float32
scale per block of 256). One exchange of B bytes takes
    max(B / bandwidth, host stage) + rounds x latency
where bandwidth = dcn_gbps x dcn_efficiency, capped by the streams' windows (streams x peers x
window / round trip) and the host stage is encoding/decoding and per-chunk work (not modelled
until calibrated). Pods of several hosts then gather the summed blocks over ICI (hosts.Assembler).
Per step:
  every step, fused       compute + exchange (all of it exposed)
  every step, overlapped  compute + per-layer program cost + max(X - backward / M, tail), where the
                          last microbatch's backward (overlap.py) hides the exchange X and the
                          tail is sending what is ready only when the backward ends (embedding,
                          rest of block 0)
  DiLoCo                  inner compute; every H/F steps one fragment (1/F of the parameters, in
                          sync.outer_dtype) is exchanged, hidden by the overlap_steps inner steps
                          that follow it: what exceeds them is exposed, amortised over H/F steps.
Every candidate's step also carries Calibration.step_overhead_s: what a real run's step costs
beyond compute, update and exchange (the control plane, waiting for the slower pod, and what the
exchange costs beyond the model; 0 on paper). `tune --dcn` calibrates it on a run of the same kind
of step: fused, overlapped, or DiLoCo's inner steps, which send nothing.
Weak scaling is one pod's step (the same tokens per pod, no DCN) over the projected step.
The inputs (model, layout, chip, links, candidate) are cost_inputs.py's; its Calibration holds
every term that is not arithmetic, named, with where its value comes from.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from multipod.controller.tune.cost_inputs import Calibration, Chip, Layout, Links, ModelShape, SyncChoice
from multipod.pod_worker.schema import MAX_STREAMS, Compression, OuterDtype, SyncConfig, SyncMode

BLOCK = 256            # values per float32 scale of int8 and int4 (pod_worker/dcn/wire.py BLOCK)
SCALE_BYTES = 4
LOSSY_MIN_GAIN = 0.05  # a math-changing candidate is recommended only if >= 5% faster than exact sync
TIE = 0.02             # ... and then the least lossy one within 2% of the fastest lossy one
# The grids the plan searches (every-step compression, DiLoCo H x F x outer dtype).
EVERY_STEP_COMPRESSIONS = (Compression.NONE, Compression.BF16, Compression.INT8, Compression.INT4)
DILOCO_INNER_STEPS = (10, 20, 50, 100)
DILOCO_FRAGMENTS = (1, 2, 4)
DILOCO_OUTER_DTYPES = (OuterDtype.FLOAT32, OuterDtype.INT8, OuterDtype.INT4)
# sync.mode = "diloco" runs on pods of several hosts too (each host exchanges its block of a fragment:
# pod_worker/diloco_hosts.py), so the plan proposes DiLoCo whatever the pod's host count.
DILOCO_ON_SEVERAL_HOSTS = True


@dataclass(frozen=True)
class Projection:
    """One candidate's projected step; times in seconds, bytes per pod (sent, per step)."""
    choice: SyncChoice
    forward_s: float
    backward_s: float
    overlap_cost_s: float      # the overlapped step's extra programs and recompute
    exchange_s: float          # one exchange: the whole gradient, or one DiLoCo fragment
    exposed_s: float           # exchange time not hidden, per step (DiLoCo: amortised)
    ici_s: float               # per step: gathering the summed blocks over the pod's hosts
    jitter_s: float            # per step: waiting for the slowest pod
    step_s: float
    one_pod_step_s: float
    dcn_bytes_per_step: float

    @property
    def weak_scaling(self) -> float:
        return self.one_pod_step_s / self.step_s

    @property
    def tier(self) -> str:
        return "lossy" if self.choice.lossy else "exact"

    def as_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "choice"}
        return {"label": self.choice.label(), "tier": self.tier, "settings": self.choice.settings(), **fields,
                "exposed_comm_s": self.exposed_s + self.ici_s, "weak_scaling": self.weak_scaling}


def bytes_per_value(compression: Compression | str, grad_bytes: int = 4) -> float:
    """Bytes one gradient value takes on the wire, the block scales included (wire.py's nbytes()
    for a chunk of whole blocks)."""
    compression = Compression(compression)
    if compression is Compression.NONE:
        return float(grad_bytes)
    if compression is Compression.BF16:
        return 2.0
    return (1.0 if compression is Compression.INT8 else 0.5) + SCALE_BYTES / BLOCK


def collective_factor(pods: int) -> float:
    """The share of the gradient one pod sends (and receives) per exchange: 0 alone, the whole
    gradient for 2 pods, 2(N-1)/N for N > 2 (reduce-scatter + all-gather)."""
    return 0.0 if pods < 2 else 1.0 if pods == 2 else 2.0 * (pods - 1) / pods


def rounds(pods: int) -> int:
    """Latency-bound rounds per exchange: one for 2 pods, two (scatter, gather) for more."""
    return 0 if pods < 2 else 1 if pods == 2 else 2


def effective_dcn_bytes_per_s(links: Links, layout: Layout, streams: int, cal: Calibration) -> float:
    """One pod's sending rate: the link's rate x efficiency, capped by the windows of its streams
    (every host of the pod has `streams` to the same host of each other pod)."""
    rate = links.dcn_gbps * 1e9 / 8 * cal.dcn_efficiency
    rtt = 2 * links.dcn_latency_ms / 1e3
    if rtt > 0 and layout.pods > 1:
        connections = layout.hosts_per_pod * streams * (layout.pods - 1)
        rate = min(rate, connections * cal.stream_window_bytes / rtt)
    return rate


def streams_needed(links: Links, layout: Layout, cal: Calibration) -> int:
    """The fewest streams per peer (at least the links' own) whose windows fill the link, at most
    MAX_STREAMS."""
    full = links.dcn_gbps * 1e9 / 8 * cal.dcn_efficiency
    for streams in range(links.streams, MAX_STREAMS + 1):
        if effective_dcn_bytes_per_s(links, layout, streams, cal) >= full:
            return streams
    return MAX_STREAMS


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1, 1/sqrt(pi) for 2), by quadrature."""
    if n < 2:
        return 0.0
    step, total = 0.01, 0.0
    for i in range(-1000, 1001):
        x = i * step
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * cdf ** (n - 1) * step
    return total


def exchange_time(sent_bytes: float, values: float, layout: Layout, links: Links, choice: SyncChoice,
                  compression: Compression, cal: Calibration) -> float:
    """Seconds for one pod to send sent_bytes (values values) and receive as many."""
    if sent_bytes <= 0:
        return 0.0
    transmit = sent_bytes / effective_dcn_bytes_per_s(links, layout, choice.streams or links.streams, cal)
    host = math.ceil(sent_bytes / choice.chunk_bytes) * cal.chunk_overhead_s
    rate = cal.host_values_per_s.get(compression.value)
    if rate:
        host += values / rate
    return max(transmit, host) + rounds(layout.pods) * links.dcn_latency_ms / 1e3


def assembly_time(values: float, model: ModelShape, layout: Layout, links: Links) -> float:
    """Gathering the summed blocks over a pod's hosts (hosts.Assembler: an all-gather over ICI):
    each chip receives the other hosts' blocks of its model shard. None with one host, fully
    sharded pods, or one pod."""
    k = layout.hosts_per_pod
    if k == 1 or layout.fully_sharded or layout.pods == 1:
        return 0.0
    per_chip = (k - 1) / k * values * model.grad_bytes / layout.model_parallel
    return per_chip / (links.ici_gbps * 1e9 / 8) + links.ici_latency_ms / 1e3


def project(model: ModelShape, layout: Layout, chip: Chip, links: Links, choice: SyncChoice,
            cal: Calibration = Calibration()) -> Projection:
    """One candidate's projected step (see the module docstring for the formulas)."""
    compute = layout.tokens_per_pod * model.flops_per_token / (layout.chips_per_pod * chip.peak_flops * chip.mfu)
    forward = compute / (1 + cal.backward_ratio)
    backward = compute - forward
    one_pod = compute + cal.update_s
    n = layout.pods
    jitter = cal.jitter_cv * compute * expected_max_normal(n)
    if choice.sync.diloco:
        sync = choice.sync
        period = sync.period
        values = model.params / sync.fragments
        compression = sync.outer_dtype.compression
        sent = values * bytes_per_value(compression, model.grad_bytes) * collective_factor(n)
        exchange = exchange_time(sent, values * collective_factor(n), layout, links, choice, compression, cal)
        ici = assembly_time(values, model, layout, links) / period
        exposed = (max(0.0, exchange - sync.overlap_steps * one_pod) + cal.outer_update_s) / period
        jitter /= math.sqrt(period)     # pods drift apart over `period` steps, then wait once
        # step_overhead_s: calibrated on a run of DiLoCo's inner steps (`tune --dcn`), never on
        # one that exchanges every step, whose residual is mostly its exchange not hiding
        # (docs/benchmarks.md, "DiLoCo candidates as trials": 539-585 ms measured, 868 predicted).
        step = one_pod + exposed + ici + jitter + cal.step_overhead_s
        return Projection(choice, forward, backward, 0.0, exchange, exposed, ici, jitter, step, one_pod, sent / period)
    values = float(model.params)
    sent = values * bytes_per_value(choice.compression, model.grad_bytes) * collective_factor(n)
    exchange = exchange_time(sent, values * collective_factor(n), layout, links, choice, choice.compression, cal)
    ici = assembly_time(values, model, layout, links)
    overlap_cost = 0.0
    exposed = exchange
    if choice.overlap and n > 1:
        programs = (2 * model.n_layers + 3) * layout.microbatches
        overlap_cost = programs * cal.program_launch_s + backward / model.n_layers * cal.block0_recompute_layers
        latency = rounds(n) * links.dcn_latency_ms / 1e3
        tail = model.last_ready_fraction * (exchange - latency) + latency
        exposed = max(exchange - backward / layout.microbatches, tail)
    step = compute + overlap_cost + exposed + ici + cal.update_s + jitter + cal.step_overhead_s
    return Projection(choice, forward, backward, overlap_cost, exchange, exposed, ici, jitter, step, one_pod, sent)


def candidates(model: ModelShape, layout: Layout, chip: Chip, links: Links,
               cal: Calibration = Calibration()) -> list[SyncChoice]:
    """Every candidate the plan ranks: every-step sync fused and overlapped with each compression
    (bf16 left out where the gradient is bf16 already), and DiLoCo over H x F x outer dtype with
    the fewest overlap steps that hide a fragment's exchange (at most H/F - 1); no DiLoCo on pods
    of several hosts unless DILOCO_ON_SEVERAL_HOSTS."""
    streams = streams_needed(links, layout, cal)
    found = [SyncChoice(overlap, c, streams=streams) for overlap in (False, True) for c in EVERY_STEP_COMPRESSIONS
             if not (c is Compression.BF16 and model.grad_bytes == 2)]
    if layout.hosts_per_pod > 1 and not DILOCO_ON_SEVERAL_HOSTS:
        return found
    for h in DILOCO_INNER_STEPS:
        for f in DILOCO_FRAGMENTS:
            if f > model.n_layers or h % f:
                continue
            for dtype in DILOCO_OUTER_DTYPES:
                plain = SyncChoice(sync=SyncConfig(mode=SyncMode.DILOCO, inner_steps=h, fragments=f,
                                                   outer_dtype=dtype), streams=streams)
                first = project(model, layout, chip, links, plain, cal)
                tau = min(h // f - 1, math.ceil(first.exchange_s / first.one_pod_step_s)) if first.exchange_s else 0
                found.append(dataclasses.replace(plain, sync=dataclasses.replace(plain.sync, overlap_steps=tau)))
    return found


def rank(projections: list[Projection]) -> list[Projection]:
    """Exact sync first, then the math-changing tier; each by projected step, then lossiness."""
    return sorted(projections, key=lambda p: (p.choice.lossy, round(p.step_s, 12), p.choice.lossiness()))


def recommend(projections: list[Projection], allow_lossy: bool) -> Projection:
    """The fastest exact candidate; with allow_lossy, the least lossy math-changing candidate
    within TIE of the fastest one instead, if that one is at least LOSSY_MIN_GAIN faster."""
    exact = [p for p in projections if not p.choice.lossy]
    best = min(exact, key=lambda p: p.step_s)
    lossy = [p for p in projections if p.choice.lossy]
    if not allow_lossy or not lossy:
        return best
    fastest = min(p.step_s for p in lossy)
    if fastest > best.step_s * (1 - LOSSY_MIN_GAIN):
        return best
    return min((p for p in lossy if p.step_s <= fastest * (1 + TIE)), key=lambda p: p.choice.lossiness())


def plan(model: ModelShape, layout: Layout, chip: Chip, links: Links, allow_lossy: bool = False,
         cal: Calibration = Calibration()) -> tuple[list[Projection], Projection]:
    """Validate the inputs (ConfigError naming the field), project every candidate, and return
    them ranked with the recommended one."""
    for part in (model, layout, chip, links, cal):
        part.validate()
    ranked = rank([project(model, layout, chip, links, c, cal) for c in candidates(model, layout, chip, links, cal)])
    return ranked, recommend(ranked, allow_lossy)
