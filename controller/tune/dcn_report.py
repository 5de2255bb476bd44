"""What `multipod tune --dcn` prints and writes: the link and compute it measured, the best
predicted candidates, and every trial predicted against measured (error), ranked by measured in
two tiers (exact; lossy, with its final loss against exact sync's), the choice marked."""
from __future__ import annotations

import json
import pathlib

from multipod.controller.tune import cost
from multipod.controller.tune.dcn_probe import ComputeMeasurement, LinkMeasurement, encryption_summary
from multipod.controller.tune.dcn_tuner import Trial, describe

PREDICTED_SHOWN = 10


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def link_line(link: LinkMeasurement) -> str:
    best = max(link.variants, key=lambda v: v.gbps)
    how = "measured" if link.measured else "given"
    crypto = "" if link.encrypted is None else ", CURVE-encrypted" if link.encrypted else ", unencrypted"
    pod = f" per pod (its {link.hosts_per_pod} hosts at once)" if link.hosts_per_pod > 1 else ""
    return (f"link {how}: {best.gbps:.3f} Gb/s each way{pod} at best, {link.latency_ms:.2f} ms per exchange "
            f"round{crypto}")


def trial_line(trial: Trial) -> str:
    if not trial.ok:
        return f"failed: {trial.error}"
    error = trial.prediction_error
    loss = "" if trial.loss_delta is None else f", loss {trial.loss_delta:+.4f} vs exact"
    return (f"measured {ms(trial.measured_step_s)}/step, predicted {ms(trial.projection.step_s)} "
            f"({error:+.0%}){loss}")


def print_report(link: LinkMeasurement, compute: ComputeMeasurement, ranked: list[cost.Projection],
                 trials: list[Trial], chosen: Trial | None, allow_lossy: bool, runs=(),
                 calibrated: dict | None = None) -> None:
    print()
    print(f"multipod tune --dcn: {link_line(link)}")
    if link.encryption is not None:
        print(f"  {encryption_summary(link.encryption)}")
    print(f"  layout probe, one pod alone: step without exchange {ms(compute.step_s)} (forward "
          f"{ms(compute.forward_s)}, backward {ms(compute.backward_s)}, update + checksum {ms(compute.update_s)}; "
          f"overlapped step {ms(compute.overlapped_step_s)})")
    for run in runs:
        label = "DiLoCo inner steps" if run.choice.sync.diloco else run.choice.label()
        print(f"  calibration run ({label}, {run.choice.streams} stream(s), "
              f"{run.choice.chunk_bytes / 2**20:g} MiB chunks, {run.steps} steps): step {ms(run.step_s)}, compute "
              f"{ms(run.compute_s)}, update + checksum {ms(run.update_s)}, exposed exchange "
              f"{ms(run.exposed_exchange_s)}")
    for kind, (_, _, _, calibration) in (calibrated or {}).items():
        hosts = ", ".join(f"{k} {v / 1e6:.0f} M values/s" for k, v in calibration.host_values_per_s.items()) or "-"
        print(f"  calibrated, {kind} step: overhead "
              f"{ms(calibration.step_overhead_s)}, backward/forward {calibration.backward_ratio:.2f}, per-layer "
              f"program {ms(calibration.program_launch_s)}, host-bound compression {hosts}")
    print()
    print(f"best predicted of {len(ranked)} candidates:")
    header = f"  {'tier':<5}  {'candidate':<66} {'step':>10} {'exposed':>10} {'DCN bytes/step':>15}"
    print(header)
    shown = [p for p in ranked if not p.choice.lossy][:PREDICTED_SHOWN // 2] + \
        [p for p in ranked if p.choice.lossy][:PREDICTED_SHOWN // 2]
    for p in shown:
        print(f"  {p.tier:<5}  {describe(p):<66} {ms(p.step_s):>10} {ms(p.exposed_s):>10} "
              f"{p.dcn_bytes_per_step:>15,.0f}")
    print()
    print("trial runs, ranked by measured step (exact tier first):")
    header = f"  {'#':>2} {'tier':<5}  {'candidate':<66} {'measured':>10} {'predicted':>10} {'error':>7} " \
             f"{'loss vs exact':>13}"
    print(header)
    for i, t in enumerate(trials, 1):
        mark = " *" if t is chosen else ""
        if not t.ok:
            print(f"  {i:>2} {t.projection.tier:<5}  {describe(t.projection):<66} failed: {t.error[:120]}")
            continue
        delta = "" if t.loss_delta is None else f"{t.loss_delta:+.4f}"
        print(f"  {i:>2} {t.projection.tier:<5}  {describe(t.projection):<66} {ms(t.measured_step_s):>10} "
              f"{ms(t.projection.step_s):>10} {t.prediction_error:>+7.0%} {delta:>13}{mark}")
    errors = [abs(t.prediction_error) for t in trials if t.prediction_error is not None]
    if errors:
        print(f"  prediction error: at most {max(errors):.0%} over {len(errors)} trial(s)")
    if chosen is not None:
        why = "changes the math" if chosen.projection.choice.lossy else "exact sync"
        print(f"chosen (*): {describe(chosen.projection)} ({why})")
    if not allow_lossy:
        fast = [t for t in trials if t.ok and t.projection.choice.lossy]
        if fast and chosen is not None and chosen.measured_step_s and \
                min(t.measured_step_s or 0 for t in fast) < chosen.measured_step_s:
            print("  a lossy candidate ran faster: --allow-lossy may choose it (check its loss above)")


def write_json(path: str | pathlib.Path, link: LinkMeasurement, compute: ComputeMeasurement,
               ranked: list[cost.Projection], trials: list[Trial], chosen: Trial | None, runs=(),
               calibrated: dict | None = None) -> None:
    import dataclasses
    report = {"link": link.as_dict(),
              "calibration_runs": [run.as_dict() for run in runs],
              "calibration": {str(kind): dataclasses.asdict(c[3]) for kind, c in (calibrated or {}).items()},
              "compute": {"step_s": compute.step_s, "compute_s": compute.compute_s, "forward_s": compute.forward_s,
                          "backward_s": compute.backward_s, "update_s": compute.update_s,
                          "overlapped_step_s": compute.overlapped_step_s},
              "predicted": [{"rank": i, "candidate": describe(p), **p.as_dict()} for i, p in enumerate(ranked, 1)],
              "trials": [{"rank": i, **t.as_dict()} for i, t in enumerate(trials, 1)],
              "chosen": None if chosen is None else chosen.as_dict()}
    pathlib.Path(path).write_text(json.dumps(report, indent=2) + "\n")
