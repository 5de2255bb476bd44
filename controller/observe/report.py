"""`multipod report RUN_DIR`: one picture of a run (report.png) from its metrics.jsonl and
events.jsonl.

Three parts, so that a test can check what is plotted without reading pixels:
- report_input.py reads the files (`read_metrics`, `read_events`; ReportError naming the file and
  the line);
- report_series.py `report_series(records, evals, events)`: a pure function from the parsed lines
  (StepRecord, evaluation records, Event) to named series (plain lists and dicts);
- report_figure.py `figure(series)`: plots those series, and only those, on a matplotlib Figure
  (a test can look at its artists).
This module ties them together: `draw(series, path)` saves the figure as a PNG, `write_report`
draws a run directory's.
"""
from __future__ import annotations

import pathlib

from multipod.controller.observe.report_figure import figure
from multipod.controller.observe.report_input import ReportError, read_events, read_metrics
from multipod.controller.observe.report_series import report_series


def draw(series: dict, path: pathlib.Path) -> list[str]:
    """Plot `series` (from report_series) as one PNG at `path` (the panels of `figure`); returns
    the panels' titles, in figure's order."""
    fig, axes = figure(series)
    titles = [ax.get_title() for ax in axes.values()]
    path = pathlib.Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        fig.savefig(partial, format="png")
        partial.replace(path)       # never a half-written report.png
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ReportError(f"{path}: cannot be written: {exc}") from None
    return titles


def write_report(run_dir: pathlib.Path, out: pathlib.Path | None = None) -> pathlib.Path:
    """Read RUN_DIR's metrics.jsonl (required) and events.jsonl (optional), draw the report to
    `out` (default RUN_DIR/report.png) and return its path; ReportError naming the file if not."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    records, evals = read_metrics(run_dir / "metrics.jsonl")
    events = read_events(run_dir / "events.jsonl")
    series = report_series(records, evals, events)
    if not series["steps"]:
        raise ReportError(f"{run_dir / 'metrics.jsonl'}: no record of a training step (none has a \"loss\")")
    path = pathlib.Path(out) if out is not None else run_dir / "report.png"
    draw(series, path)
    return path
