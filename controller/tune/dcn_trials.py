"""The trial runs of `multipod tune --dcn`: a candidate's [dcn]/[sync] settings trained for a few
steps on the pods the link was measured between, by the same run `multipod local` and `multipod
train` make (controller/run/training.py run_training), each in a run directory of its own.

What a trial measured is read back from its metrics.jsonl (controller/observe/records.py): the
step time is the controller's step_time_s after `warmup` steps, the median for every-step sync and
the mean for DiLoCo (whose outer exchanges come every H/F steps: the mean is what they cost over a
run, as the cost model amortises them); the final loss is the mean training loss of the last
LOSS_STEPS steps (a batch is a function of (seed, step): every trial sees the same batches).

The calibration run (run_calibration) is such a run too, of the reference candidate (fused, exact,
on the fastest measured link variant), before anything is predicted: its records give the cost
model what one pod's probe alone cannot (RunCalibration): the slowest pod's compute while every pod
computes at once on this machine's cores, the update and checksum, and the step the controller
measured. controller/tune/dcn_tuner.py calibrate() turns them into the model's terms.
"""
from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass

from multipod.controller.tune import cost, cost_inputs
from multipod.controller.tune.dcn_tuner import Trial, overrides

LOSS_STEPS = 3
# A trial trains; it does not evaluate, sample or checkpoint (its run directory keeps its metrics).
QUIET = ("eval.batches=0", "sample.tokens=0", "checkpoint.every=0", "run.measure_peak=false")
# A trial sends its chunks raw, as the cost model counts their bytes: dcn.lossless = auto would
# pack them on a slow link, by a ratio that depends on the values and the compression (not
# modelled yet), and the calibration run's residual would take in part of it. A run of the
# written config, with auto, is then at most as slow as predicted on such a link.
RAW = ('dcn.lossless="off"',)


def trial_overrides(base: list[str], choice: cost_inputs.SyncChoice, steps: int) -> list[str]:
    """The base config's overrides, the candidate's settings, and the trial's length."""
    return [*base, *QUIET, *RAW, f"run.steps={steps}", *overrides(choice)]


def read_steps(run_dir: pathlib.Path) -> list[dict]:
    """The step records of a run's metrics.jsonl (evaluation records left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if "loss" in r]


def summarize(records: list[dict], diloco: bool, warmup: int, loss_at: int | None = None
              ) -> tuple[float | None, float | None]:
    """(measured step seconds, final loss) of a trial's step records; (None, None) if too few.
    The loss is the mean of the LOSS_STEPS steps up to step `loss_at` (default: the last), so
    that trials of different lengths (DiLoCo's are longer) compare at the same step."""
    timed = [r["step_time_s"] for r in records[warmup:] if r.get("step_time_s")]
    if not timed:
        return None, None
    step = statistics.fmean(timed) if diloco else statistics.median(timed)
    end = len(records) if loss_at is None else min(loss_at, len(records))
    losses = [r["loss"] for r in records[max(0, end - LOSS_STEPS):end]]
    return step, statistics.fmean(losses)


def run_trial(config_path: str | None, base_overrides: list[str], projection: cost.Projection, addresses: list,
              run_dir: pathlib.Path, steps: int, warmup: int, loss_at: int | None = None) -> Trial:
    """Train the candidate for `steps` steps on the pods at `addresses`; its Trial (with the error
    if the run failed: a candidate that cannot run is a row of the report, not the tuner's end),
    its loss taken up to step `loss_at` (summarize)."""
    from multipod.controller.core.run_config import load_config
    from multipod.controller.data.corpus import prepare
    from multipod.controller.run.training import run_training
    choice = projection.choice
    try:
        config = load_config(config_path, trial_overrides(base_overrides, choice, steps))
        data = prepare(config, progress=False)
        run_training(data.config, addresses, run_dir, data=data, local=True)
    except Exception as exc:    # noqa: BLE001 -- a failed trial is reported with its error
        return Trial(projection, None, error=f"{type(exc).__name__}: {exc}"[:500])
    step, loss = summarize(read_steps(run_dir), choice.sync.diloco, warmup, loss_at)
    if step is None:
        return Trial(projection, None, error=f"no timed steps in {run_dir / 'metrics.jsonl'}")
    return Trial(projection, step, loss)


@dataclass(frozen=True)
class RunCalibration:
    """What the calibration run measured, medians over its steps after the warm-up (seconds)."""
    choice: cost_inputs.SyncChoice  # the candidate it ran (fused, exact)
    step_s: float               # the controller's step time
    compute_s: float            # forward + backward, the slowest pod's (StepRecord.compute_time_s)
    update_s: float             # sum + update + checksum (+ fingerprint), the slowest pod's
    exposed_exchange_s: float   # the exchange the step waited for, peers' lateness included
    steps: int                  # steps timed

    def as_dict(self) -> dict:
        return {"candidate": self.choice.label(), "streams": self.choice.streams,
                "chunk_bytes": self.choice.chunk_bytes, "step_s": self.step_s, "compute_s": self.compute_s,
                "update_s": self.update_s, "exposed_exchange_s": self.exposed_exchange_s, "steps": self.steps}


def calibration_of(records: list[dict], choice: cost_inputs.SyncChoice, warmup: int) -> RunCalibration | None:
    """The medians of a calibration run's step records after `warmup` (None if none was timed)."""
    timed = [r for r in records[warmup:] if r.get("step_time_s")]
    if not timed:
        return None

    def median(key) -> float:
        return statistics.median(key(r) for r in timed)
    return RunCalibration(choice, median(lambda r: r["step_time_s"]), median(lambda r: r["compute_time_s"]),
                          median(lambda r: r["update_time_s"] + r["checksum_time_s"]
                                 + r.get("fingerprint_time_s", 0.0)),
                          median(lambda r: r["exposed_exchange_s"]), len(timed))


def run_calibration(config_path: str | None, base_overrides: list[str], choice: cost_inputs.SyncChoice, addresses: list,
                    run_dir: pathlib.Path, steps: int, warmup: int) -> RunCalibration:
    """Train the reference candidate for `steps` steps on the pods; its RunCalibration, or
    ConfigError("calibration run") naming why not."""
    from multipod.controller.core.run_config import ConfigError, load_config
    from multipod.controller.data.corpus import prepare
    from multipod.controller.run.training import run_training
    try:
        config = load_config(config_path, trial_overrides(base_overrides, choice, steps))
        data = prepare(config, progress=False)
        run_training(data.config, addresses, run_dir, data=data, local=True)
    except Exception as exc:    # noqa: BLE001 -- named below
        raise ConfigError("calibration run", f"{type(exc).__name__}: {exc}"[:500]) from None
    found = calibration_of(read_steps(run_dir), choice, warmup)
    if found is None:
        raise ConfigError("calibration run", f"no timed steps in {run_dir / 'metrics.jsonl'}")
    return found
