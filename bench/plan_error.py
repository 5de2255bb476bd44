"""`multipod plan`'s error on this machine: its projections against the steps `multipod tune --dcn`
measured, with the cost model's default terms and with the terms calibrated on the runs.

Input: what one `multipod tune --dcn ... --json R.json --plan-out P.toml` wrote. P.toml is the
measured cluster with the calibration of the chosen candidate's kind of step
(controller/tune/dcn_plan_file.py); R.json holds every trial's measured step. For each trial this
projects the same candidate (matched by its label) with `multipod plan --from P.toml` twice:
  calibrated   the file as written: the terms measured on this machine;
  defaults     the same cluster without its [calibration] table: cost_inputs.Calibration's estimates,
               what a user who knows only the link's rate and a pod's compute would get.
Prints one JSON object: per trial, measured, tune's prediction, and both projections with their
errors ((projected - measured) / measured), and the largest absolute error of each.

    python -m bench.plan_error --tune-json R.json --plan-file P.toml
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import sys
import tempfile
import tomllib


def project(plan_file: pathlib.Path) -> dict[str, float]:
    """label -> projected step seconds, from `multipod plan --from plan_file --allow-lossy --json`."""
    from multipod.cli import build_parser
    from multipod.controller.commands import run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(build_parser().parse_args(["plan", "--from", str(plan_file), "--allow-lossy", "--json"]))
    if code != 0:
        raise SystemExit(f"multipod plan --from {plan_file} failed ({code})")
    return {c["label"]: c["step_s"] for c in json.loads(out.getvalue())["candidates"]}


def without_calibration(plan_file: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """A copy of the plan file without its [calibration] table."""
    import tomli_w
    document = tomllib.loads(plan_file.read_text())
    document.pop("calibration", None)
    path = directory / "defaults.toml"
    path.write_text(tomli_w.dumps(document))
    return path


def error(projected: float | None, measured: float) -> float | None:
    return None if projected is None else (projected - measured) / measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune-json", required=True, type=pathlib.Path, help="tune --dcn's --json report")
    parser.add_argument("--plan-file", required=True, type=pathlib.Path, help="tune --dcn's --plan-out file")
    args = parser.parse_args(argv)
    report = json.loads(args.tune_json.read_text())
    calibrated = project(args.plan_file)
    with tempfile.TemporaryDirectory() as tmp:
        defaults = project(without_calibration(args.plan_file, pathlib.Path(tmp)))
    rows = []
    for trial in report["trials"]:
        measured = trial["measured_step_s"]
        if measured is None:
            continue
        on_paper, on_defaults = calibrated.get(trial["label"]), defaults.get(trial["label"])
        rows.append({"candidate": trial["candidate"], "measured_step_s": measured,
                     "tune_predicted_s": trial["predicted_step_s"], "tune_error": trial["prediction_error"],
                     "plan_calibrated_s": on_paper, "plan_calibrated_error": error(on_paper, measured),
                     "plan_defaults_s": on_defaults, "plan_defaults_error": error(on_defaults, measured)})

    def worst(key: str) -> float | None:
        found = [abs(r[key]) for r in rows if r[key] is not None]
        return max(found) if found else None
    json.dump({"tune_json": str(args.tune_json), "plan_file": str(args.plan_file), "trials": rows,
               "max_abs_error": {k: worst(k) for k in ("tune_error", "plan_calibrated_error", "plan_defaults_error")}},
              sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
