"""What `multipod tune --dcn --plan-out FILE` writes: the cluster it measured and the cost model's
terms as it calibrated them, as a `multipod plan --from FILE` input (controller/commands/plan.py).

`multipod plan` projects clusters this machine cannot run with the same cost model
(controller/tune/cost.py). Its defaults are estimates; this file replaces them with what the runs
measured here, so that a plan can start from a calibrated machine and change only what differs
(`multipod plan --from FILE --pods 64`):
  [plan]         pods, hosts per pod, chips = the devices per pod (all its hosts'), the tokens per step;
                 peak_tflops with mfu = 1: the calibrated compute (the calibration run's slowest pod,
                 every pod busy) expressed as a peak, so that peak x mfu gives the measured step's
                 compute; dcn_gbps the link's rate (the shaped rate when one was set, then
                 dcn_efficiency is the data plane's measured share of it; a pod's, every host at
                 once), dcn_latency_ms per round, streams of the fastest variant; ici_gbps
                 dcn_tuner.ICI_GBPS (the gather over a pod's hosts is inside the calibrated step
                 overhead)
  [model]        the run config's model, as loaded (its --set values included)
  [calibration]  the terms of the chosen candidate's kind of step (dcn_tuner.StepKind): each kind
                 has its own under contention, and a plan has one. `multipod plan` on this file
                 therefore projects the chosen candidate as `tune --dcn` predicted it
"""
from __future__ import annotations

import dataclasses
import pathlib

from multipod.controller.tune import cost_inputs
from multipod.controller.tune.dcn_probe import LinkMeasurement
from multipod.controller.tune.dcn_tuner import ICI_GBPS


def plan_document(config, link: LinkMeasurement, pods: int, devices: int, chip: cost_inputs.Chip,
                  calibration: cost_inputs.Calibration, shaped_gbps: float | None = None,
                  hosts_per_pod: int = 1) -> dict:
    """The [plan], [model] and [calibration] tables (module docstring); devices: a pod's, all its
    hosts' together."""
    best = max(link.variants, key=lambda v: v.gbps)
    rate, efficiency = best.gbps, 1.0
    if shaped_gbps:
        # The shaped rate is the link's; what the data plane reached of it is dcn_efficiency.
        rate, efficiency = shaped_gbps, min(1.0, best.gbps / shaped_gbps)
    table = {"pods": pods, "hosts_per_pod": hosts_per_pod, "chips_per_pod": devices,
             "peak_tflops": chip.peak_flops / 1e12, "mfu": 1.0, "ici_gbps": ICI_GBPS, "dcn_gbps": rate,
             "dcn_latency_ms": link.latency_ms, "streams": best.streams,
             "batch": config.data.global_batch, "seq_len": config.data.seq_len,
             "microbatches": config.model.microbatches, "model_parallel": config.mesh.model}
    terms = dataclasses.asdict(dataclasses.replace(calibration, dcn_efficiency=efficiency))
    terms["host_values_per_s"] = {str(k): float(v) for k, v in terms["host_values_per_s"].items()}
    return {"plan": table, "model": config.to_dict()["model"], "calibration": terms}


def write_plan_file(path: str | pathlib.Path, document: dict, header: list[str]) -> None:
    """The document as TOML, with the header as comments."""
    import tomli_w
    comments = "".join(f"# {line}\n" for line in header if line)
    pathlib.Path(path).write_text(comments + "\n" + tomli_w.dumps(document))
