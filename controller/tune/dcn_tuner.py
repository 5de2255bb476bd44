"""The candidates of `multipod tune --dcn`, predicted with the cost model from what was measured,
and the choice among the ones that ran. Pure Python: the measurements come in as values
(controller/tune/dcn_probe.py), the trial runs' results too (controller/tune/dcn_trials.py).

Calibration from the measurements (nothing assumed where a figure was measured):
  compute     Chip(peak, mfu = 1) set so that the cost model's compute is the calibration run's
              median compute (the slowest pod's forward + backward while every pod computes on the
              shared cores; without a run: the layout probe's); backward_ratio = the probe's
              backward / forward; update_s = the run's median update + checksum (the probe's step
              minus its compute without a run)
  overhead    step_overhead_s = the calibration run's median step minus what the model, calibrated
              on everything else, predicts for the candidate it ran (the control plane's step RPCs
              and waiting for the slower pod: what no probe of one pod or of the link contains);
              at least 0
  three steps the fused step, the overlapped step and DiLoCo's inner step (StepKind) each calibrated
              on a run of its own (calibrations): under contention they differ by more than the
              probes of one pod alone show (bench model on loopback: overlapped 7% faster alone, 20%
              faster in the run); a candidate is predicted with its own step's terms (the overlapped
              run's compute holds the per-layer programs' cost: program_launch_s 0). DiLoCo's run
              (diloco_reference) takes no outer step, so its overhead is the inner step's alone:
              an every-step run's residual is mostly exchange that did not hide, which an inner step
              does not send (0.1 Gb/s: DiLoCo trials predicted +48..+61% with it, -16..-26% with
              none); without that run, DiLoCo is predicted with no overhead
  link        one Links per measured (streams, chunk) variant: its rate (dcn_efficiency = 1: the rate
              is the data plane's own; a pod's, every host probed at once), the measured latency per
              exchange round
  layout      the run's pods of hosts_per_pod hosts and devices per pod (all its hosts' chips): the
              streams' window cap counts every host's streams; the gather of the summed blocks over
              the hosts (cost.assembly_time) is inside the calibration runs' overhead (ICI_GBPS)
  overlap     the overlapped step's measured extra cost spread over its per-layer programs
              (program_launch_s; block0_recompute_layers = 0: it is inside that figure)
  host        host_values_per_s of each compression whose probe was bound by the hosts

The candidates: cost.candidates' (every-step fused or overlapped with each compression, DiLoCo over
H x F x outer dtype, on pods of several hosts only if cost.DILOCO_ON_SEVERAL_HOSTS) for every link
variant, restricted to --compressions. Ranked in two tiers
(exact; lossy: compression or DiLoCo); the best `exact` and `lossy` of them run; the choice is the
fastest measured exact one, or with allow_lossy a lossy one measured at least LOSSY_MIN_GAIN faster.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multipod.controller.tune import cost, cost_inputs
from multipod.controller.tune.dcn_probe import ComputeMeasurement, LinkMeasurement
from multipod.model.config import ConfigError
from multipod.pod_worker.schema import Compression, OuterDtype, SyncConfig, SyncMode

if TYPE_CHECKING:
    from multipod.controller.tune.dcn_trials import RunCalibration

# The gather of a pod's summed blocks over its hosts (cost.assembly_time) is not measured apart: with
# an ICI this fast the model counts it as nothing, and what it costs is inside the calibration runs'
# step overhead (each every-step candidate gathers the same float32 sum, whatever its compression).
# DiLoCo's gather of a fragment, once per outer sync, is left out with it (amortised over H/F steps).
ICI_GBPS = 1e6


class StepKind(enum.StrEnum):
    """The kinds of step a candidate trains with, each calibrated on a run of its own."""
    FUSED = "fused"                 # every-step sync, the exchange after the backward pass
    OVERLAPPED = "overlapped"       # every-step sync, the exchange during the backward pass
    DILOCO_INNER = "DiLoCo inner"   # DiLoCo: inner steps, no exchange (the outer syncs are modelled)


def step_kind(choice: cost_inputs.SyncChoice) -> StepKind:
    """Which calibrated step a candidate is predicted with."""
    if choice.sync.diloco:
        return StepKind.DILOCO_INNER
    return StepKind.OVERLAPPED if choice.overlap else StepKind.FUSED


def calibrate(config, compute: ComputeMeasurement, link: LinkMeasurement, pods: int, devices: int,
              run: RunCalibration | None = None, hosts_per_pod: int = 1
              ) -> tuple[cost_inputs.ModelShape, cost_inputs.Layout, cost_inputs.Chip, cost_inputs.Calibration]:
    """The cost model's inputs for this run, calibrated on the measurements (module docstring);
    devices: a pod's chips, all its `hosts_per_pod` hosts' together."""
    for name, value in (("compute.forward_s", compute.forward_s), ("compute.compute_s", compute.compute_s)):
        cost_inputs.check_number(name, value)
    if pods < 2:
        raise ConfigError("--pods", f"tuning the cross-pod sync needs at least 2 pods, got {pods}")
    if run is not None:
        cost_inputs.check_number("calibration.compute_s", run.compute_s)
        cost_inputs.check_number("calibration.step_s", run.step_s)
    shape = cost_inputs.ModelShape.from_config(config.model, config.data.seq_len)
    layout = cost_inputs.Layout(pods, hosts_per_pod, devices, config.data.global_batch * config.data.seq_len,
                                config.model.microbatches, config.mesh.model)
    layout.validate()
    compute_s = run.compute_s if run is not None else compute.compute_s
    peak = layout.tokens_per_pod * shape.flops_per_token / (devices * compute_s)
    chip = cost_inputs.Chip(peak, 1.0)
    backward_ratio = max(compute.backward_s, 1e-9) / compute.forward_s
    programs = (2 * shape.n_layers + 3) * layout.microbatches
    launch = 0.0
    if run is not None and run.choice.overlap:
        pass        # the overlapped programs' cost is inside the overlapped run's measured compute
    elif compute.overlapped_step_s is not None:
        launch = max(0.0, compute.overlapped_step_s - compute.step_s) / programs
    calibration = cost_inputs.Calibration(backward_ratio=backward_ratio, dcn_efficiency=1.0, program_launch_s=launch,
                                          block0_recompute_layers=0.0,
                                          update_s=run.update_s if run is not None else compute.update_s,
                                          host_values_per_s=dict(link.host_values_per_s))
    calibration.validate()
    if run is not None:
        links = links_of(link)[variant_index(link, run.choice)]
        projection = cost.project(shape, layout, chip, links, run.choice, calibration)
        # A DiLoCo calibration run takes no outer step: its steps are inner steps alone.
        modelled = projection.one_pod_step_s if run.choice.sync.diloco else projection.step_s
        calibration = dataclasses.replace(calibration, step_overhead_s=max(0.0, run.step_s - modelled))
    return shape, layout, chip, calibration


def variant_index(link: LinkMeasurement, choice: cost_inputs.SyncChoice) -> int:
    """The link variant measured at the choice's streams and chunk size (ConfigError if none)."""
    for i, v in enumerate(link.variants):
        if (v.streams, v.chunk_bytes) == (choice.streams, choice.chunk_bytes):
            return i
    raise ConfigError("link", f"no link variant of {choice.streams} stream(s), {choice.chunk_bytes} bytes chunks")


def reference(link: LinkMeasurement, overlap: bool = False) -> cost_inputs.SyncChoice:
    """A calibration run's candidate: every-step sync, fused or overlapped, exact, on the fastest
    measured link variant (its exchange is the one the link probe measured most directly)."""
    if not link.variants:
        raise ConfigError("link", "no link measurement: nothing to predict with")
    best = max(link.variants, key=lambda v: v.gbps)
    return cost_inputs.SyncChoice(overlap=overlap, compression=Compression.NONE, streams=best.streams,
                                  chunk_bytes=best.chunk_bytes)


def diloco_reference(link: LinkMeasurement, steps: int) -> cost_inputs.SyncChoice:
    """DiLoCo's calibration run: inner steps only (H beyond the run's `steps`, so that no outer
    sync starts), on the fastest measured link variant."""
    every_step = reference(link)
    return dataclasses.replace(every_step, sync=SyncConfig(mode=SyncMode.DILOCO, inner_steps=steps + 1,
                                                           outer_dtype=OuterDtype.FLOAT32))


def calibrations(config, compute: ComputeMeasurement, link: LinkMeasurement, pods: int, devices: int,
                 runs: tuple[RunCalibration, ...] = (), diloco_overlap: bool = False, hosts_per_pod: int = 1
                 ) -> dict[StepKind, tuple]:
    """calibrate()'s inputs for each StepKind: each from the calibration run of that step if there
    is one (the programs share this machine's cores differently: their compute under contention
    is measured, not derived from one another). Without one, an every-step kind takes the other
    every-step run's, else the probes alone; DiLoCo's inner step takes the every-step calibration
    of the program it runs (diloco_overlap: the overlapped one) with no overhead (module
    docstring)."""
    by_kind = {step_kind(run.choice): run for run in runs}
    found = {}
    for kind, other in ((StepKind.FUSED, StepKind.OVERLAPPED), (StepKind.OVERLAPPED, StepKind.FUSED)):
        found[kind] = calibrate(config, compute, link, pods, devices, by_kind.get(kind, by_kind.get(other)),
                                hosts_per_pod)
    if StepKind.DILOCO_INNER in by_kind:
        found[StepKind.DILOCO_INNER] = calibrate(config, compute, link, pods, devices, by_kind[StepKind.DILOCO_INNER],
                                                 hosts_per_pod)
    else:
        shape, layout, chip, calibration = found[StepKind.OVERLAPPED if diloco_overlap else StepKind.FUSED]
        found[StepKind.DILOCO_INNER] = (shape, layout, chip, dataclasses.replace(calibration, step_overhead_s=0.0))
    return found


def diloco_proposed(hosts_per_pod: int) -> bool:
    """Whether DiLoCo candidates are proposed (and calibrated) for pods of `hosts_per_pod` hosts:
    always on one host, on several only with cost.DILOCO_ON_SEVERAL_HOSTS (read when asked)."""
    return hosts_per_pod == 1 or cost.DILOCO_ON_SEVERAL_HOSTS


def links_of(link: LinkMeasurement) -> list[cost_inputs.Links]:
    """One cost_inputs.Links per measured variant; ConfigError naming the field if a value is not usable."""
    if not link.variants:
        raise ConfigError("link", "no link measurement: nothing to predict with")
    found = []
    for v in link.variants:
        links = cost_inputs.Links(v.gbps, link.latency_ms, ICI_GBPS, streams=v.streams)
        try:
            links.validate()
        except ConfigError as exc:
            name = {"dcn_gbps": "--link-gbps", "dcn_latency_ms": "--latency-ms"}.get(exc.field, exc.field)
            raise ConfigError(name, exc.message) from None
        found.append(links)
    return found


def predict(config, compute: ComputeMeasurement, link: LinkMeasurement, pods: int, devices: int,
            compressions: tuple[Compression, ...] = (Compression.NONE, Compression.BF16, Compression.INT8),
            diloco: bool = True, runs: tuple[RunCalibration, ...] = (), diloco_overlap: bool = False,
            hosts_per_pod: int = 1) -> list[cost.Projection]:
    """Every candidate's projection on every link variant, ranked (exact tier first); with `runs`,
    calibrated on the calibration runs too, each candidate on its step's (calibrations; DiLoCo's
    inner step runs the overlapped program if diloco_overlap: the trainer resolves dcn.overlap as
    the base config says, DiLoCo's settings leave it alone). DiLoCo candidates only where
    diloco_proposed(hosts_per_pod)."""
    calibrated = calibrations(config, compute, link, pods, devices, runs, diloco_overlap, hosts_per_pod)
    shape, layout, chip, calibration = calibrated[StepKind.FUSED]
    allowed = set(compressions) | {Compression.NONE}
    found: list[cost.Projection] = []
    for variant, links in zip(link.variants, links_of(link)):
        for choice in cost.candidates(shape, layout, chip, links, calibration):
            if choice.sync.diloco:
                if not diloco or choice.sync.outer_dtype.compression not in allowed:
                    continue
            elif choice.compression not in allowed:
                continue
            choice = dataclasses.replace(choice, streams=variant.streams, chunk_bytes=variant.chunk_bytes)
            _, _, chip_m, calibration_m = calibrated[step_kind(choice)]
            found.append(cost.project(shape, layout, chip_m, links, choice, calibration_m))
    return cost.rank(found)


def describe(p: cost.Projection) -> str:
    """A candidate's label with its data-plane setting."""
    return f"{p.choice.label()}, {p.choice.streams} stream(s), {p.choice.chunk_bytes / 2**20:g} MiB chunks"


def trial_warmup(choice: cost_inputs.SyncChoice, warmup: int) -> int:
    """The first steps of a candidate's trial that are not timed: `warmup`, and for DiLoCo also
    the first outer sync of every fragment: the first F periods (H inner steps), and the
    overlap_steps after them, at whose end the last of them is applied. Those syncs compiled the
    outer programs until they ran at configure (PodTrainer.warm_up_outer: 1.5 s on the bench
    model, 0.7 + 1.9 s on 2 pods of 2 hosts, before). The run's first outer exchange still costs
    more than later ones (55-155 ms against 20-45 on the tiny model); whether fragments 1..F-1
    may be timed now is not yet measured on the bench model, so the window stays."""
    return warmup + (choice.sync.inner_steps + choice.sync.overlap_steps if choice.sync.diloco else 0)


def trial_steps(choice: cost_inputs.SyncChoice, steps: int, warmup: int) -> int:
    """How many steps a candidate's trial trains: `steps`, or for DiLoCo its trial_warmup plus
    whole periods of its outer syncs (H/F inner steps each), at least two and at least `steps` in
    all, so that its mean step counts every outer exchange it pays, once per period."""
    if not choice.sync.diloco:
        return steps
    period, untimed = choice.sync.period, trial_warmup(choice, warmup)
    return untimed + period * max(2, math.ceil((steps - untimed) / period))


def pick_trials(ranked: list[cost.Projection], exact: int, lossy: int, max_steps: int | None = None,
                steps: int = 0, warmup: int = 0) -> list[cost.Projection]:
    """The best `exact` exact candidates and the best `lossy` lossy ones (by predicted step; a
    DiLoCo candidate only if its trial of `steps` after `warmup` (trial_steps) fits in max_steps)."""
    chosen = [p for p in ranked if not p.choice.lossy][:exact]
    runnable = [p for p in ranked if p.choice.lossy and not (
        max_steps is not None and trial_steps(p.choice, steps, warmup) > max_steps)]
    return chosen + runnable[:lossy]


@dataclass(frozen=True)
class Trial:
    """A candidate that ran: its prediction and what its run measured."""
    projection: cost.Projection
    measured_step_s: float | None       # None: the run failed
    final_loss: float | None = None
    error: str = ""
    loss_delta: float | None = None     # final loss minus the exact reference's (lossy tier)

    @property
    def ok(self) -> bool:
        return self.measured_step_s is not None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured."""
        if self.measured_step_s is None:
            return None
        return (self.projection.step_s - self.measured_step_s) / self.measured_step_s

    def as_dict(self) -> dict:
        return {"candidate": describe(self.projection), **self.projection.as_dict(),
                "predicted_step_s": self.projection.step_s, "measured_step_s": self.measured_step_s,
                "prediction_error": self.prediction_error, "final_loss": self.final_loss,
                "loss_delta_vs_exact": self.loss_delta, "error": self.error}


def with_loss_deltas(trials: list[Trial]) -> list[Trial]:
    """Each lossy trial's final loss against the first exact trial's that ran (the reference)."""
    reference = next((t for t in trials if t.ok and not t.projection.choice.lossy and t.final_loss is not None), None)
    if reference is None:
        return trials
    assert reference.final_loss is not None
    return [dataclasses.replace(t, loss_delta=t.final_loss - reference.final_loss)
            if t.projection.choice.lossy and t.ok and t.final_loss is not None else t for t in trials]


def rank_measured(trials: list[Trial]) -> list[Trial]:
    """Exact tier first, each by measured step; failed trials last."""
    return sorted(trials, key=lambda t: (not t.ok, t.projection.choice.lossy, t.measured_step_s or 0.0))


def choose(trials: list[Trial], allow_lossy: bool) -> Trial | None:
    """The fastest measured exact trial; with allow_lossy, the fastest measured lossy one instead
    if it is at least cost.LOSSY_MIN_GAIN faster. None if no exact trial ran (and no lossy one may)."""
    ran = [t for t in trials if t.ok]
    exact = [t for t in ran if not t.projection.choice.lossy]
    best = min(exact, key=lambda t: t.measured_step_s or 0.0) if exact else None
    lossy = [t for t in ran if t.projection.choice.lossy]
    if not allow_lossy or not lossy:
        return best
    fastest = min(lossy, key=lambda t: t.measured_step_s or 0.0)
    assert fastest.measured_step_s is not None
    if best is None or best.measured_step_s is None or \
            fastest.measured_step_s <= best.measured_step_s * (1 - cost.LOSSY_MIN_GAIN):
        return fastest
    return best


def overrides(choice: cost_inputs.SyncChoice) -> list[str]:
    """The chosen [dcn]/[sync] settings as `--set` values (dcn.overlap spelled as the enum)."""
    import json
    found = []
    for section, table in choice.settings().items():
        for key, value in table.items():
            found.append(f"{section}.{key}={json.dumps(value)}")
    return found
