"""`multipod report RUN_DIR`: one picture of a run (report.png) from its metrics.jsonl and
events.jsonl.

Two halves, so that a test can check what is plotted without reading pixels:
- `report_series(records, evals, events)`: a pure function from the parsed lines (StepRecord,
  evaluation records, Event) to named series (plain lists and dicts);
- `figure(series)`: plots those series, and only those, on a matplotlib Figure (a test can look
  at its artists), and `draw(series, path)` saves that as a PNG.

matplotlib is imported inside `figure` only (Agg canvas, no display needed): building the
`multipod` argument parser must stay free of it.
"""
from __future__ import annotations

import bisect
import json
import math
import pathlib
import statistics

from multipod.controller.observe.events import KINDS, Event, EventKind
from multipod.controller.observe.records import StepRecord

# The phases a step's time splits into, per pod: (series name, PodTimings field, label).
PHASES = (("compute", "compute_s", "compute"),
          ("exposed_exchange", "exposed_exchange_s", "exposed exchange"),
          ("update", "update_s", "update"))

# Events drawn as vertical lines: event name -> (marker kind, legend label, colour, line style).
MARKERS = {
    EventKind.POD_FAILURE: ("pod_failure", "pod failure", "tab:red", "-"),
    EventKind.RECOVERED: ("restored", "restored from checkpoint", "tab:purple", "-."),
    EventKind.REJOIN: ("rejoin", "pod rejoined", "tab:green", "-"),
    EventKind.HOT_SWAP: ("hot_swap", "spare took a slot", "tab:cyan", "-"),
    EventKind.OUTVOTED: ("outvoted", "corrupted pod outvoted", "tab:brown", "-"),
    EventKind.DIVERGED: ("diverged", "pods diverged: restored", "tab:purple", "--"),
    EventKind.REWIND: ("rewind", "loss-spike rewind", "tab:orange", "--"),
    EventKind.CHECKPOINT_SAVED: ("checkpoint", "checkpoint saved", "tab:gray", ":"),
    EventKind.CHECKPOINT_FAILED: ("checkpoint_failed", "checkpoint FAILED", "black", "--"),
}

FIGSIZE = (14.0, 14.0)      # inches
MARGINS = dict(left=0.06, right=0.985, bottom=0.045, top=0.975, wspace=0.17, hspace=0.36)   # figure fractions
# Row heights: the loss, the DCN bytes under it (sharing its steps), step time, tokens/s and MFU.
HEIGHTS = (3.0, 1.6, 3.0, 3.0)
DPI = 100                   # 1400 x 1400 pixels

# DiLoCo's outer steps (StepRecord.outer_sync): ticks along the bottom of the loss panel, and the
# colour of their bars on the DCN bytes panel.
OUTER_COLOUR = "tab:green"
OUTER_GID = "outer_steps"           # the ticks' artist id (a test finds them by it)
DCN_GID = "dcn_bytes"               # the bytes bars' id


class ReportError(ValueError):
    """A run directory the report cannot be drawn from (the message names the file)."""


# -- reading ---------------------------------------------------------------------------------------
def read_jsonl(path: pathlib.Path, required: bool) -> list[dict]:
    """The JSON objects of a .jsonl file, one per non-blank line. ReportError, naming the file
    (and the line), if it is missing (when required), empty (when required) or malformed."""
    return [value for _, value in _numbered(path, required)]


def _numbered(path: pathlib.Path, required: bool) -> list[tuple[int, dict]]:
    """read_jsonl's objects with their line numbers."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise ReportError(f"{path}: no such file (is this a run directory?)") from None
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot be read: {exc}") from None
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise ReportError(f"{path}, line {number}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ReportError(f"{path}, line {number}: expected a JSON object, got {type(value).__name__}")
        lines.append((number, value))
    if required and not lines:
        raise ReportError(f"{path}: empty: the run wrote no step yet")
    return lines


def read_metrics(path: pathlib.Path) -> tuple[list[StepRecord], list[dict]]:
    """metrics.jsonl's step records (the lines with a "loss", read as StepRecord) and evaluation
    records (those with an "eval_loss"), each in file order. ReportError naming the file and the
    line if the file cannot be read (read_jsonl), or a line has no integer step or is not a valid
    step record."""
    records, evals = [], []
    for number, value in _numbered(path, required=True):
        if not _is_int(value.get("step")):
            raise ReportError(f"{path}, line {number}: no integer \"step\"")
        if "eval_loss" in value:
            evals.append(value)
        elif "loss" in value:
            try:
                records.append(StepRecord.from_json(value))
            except ValueError as exc:
                raise ReportError(f"{path}, line {number}: not a step record: {exc}") from None
    return records, evals


def read_events(path: pathlib.Path) -> list[Event]:
    """events.jsonl's events, in file order (none if there is no file); kinds this version does
    not know are left out. ReportError naming the file and the line if one is malformed."""
    events = []
    for number, value in _numbered(path, required=False):
        if value.get("event") not in KINDS:
            continue
        try:
            events.append(Event.from_json(value))
        except ValueError as exc:
            raise ReportError(f"{path}, line {number}: {exc}") from None
    return events


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _num(value) -> float | None:
    """A finite-or-not float from a JSON number; None for null or anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# -- the series ------------------------------------------------------------------------------------
def latest_by_step(records: list[StepRecord]) -> list[StepRecord]:
    """The last record of each step (a step replayed after a restore or rewind replaces its
    earlier record), in step order."""
    by_step = {record.step: record for record in records}
    return [by_step[s] for s in sorted(by_step)]


def _latest_evals(evals: list[dict]) -> list[dict]:
    """The last evaluation record of each step among those with a number eval_loss, in step order."""
    by_step = {e["step"]: e for e in evals if _num(e.get("eval_loss")) is not None}
    return [by_step[s] for s in sorted(by_step)]


def _degraded_spans(train: list[StepRecord]) -> list[list[int]]:
    """[first, last] step of every run of consecutive steps with fewer live pods than slots."""
    spans: list[list[int]] = []
    for record in train:
        if record.live_pods >= len(record.hosts):
            continue
        step = record.step
        if spans and spans[-1][1] == step - 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return spans


def _step_at(when: float, records: list[StepRecord]) -> int | None:
    """The step in flight at time `when`: the one after the last step whose record was written
    before it (records in file order, each stamped at the end of its step)."""
    before = [r.step for r in records if r.time <= when]
    if before:
        return before[-1] + 1
    return records[0].step if records else None


def _markers(events: list[Event], records: list[StepRecord]) -> list[dict]:
    markers = []
    for event in events:
        if event.kind not in MARKERS:
            continue
        kind, label = MARKERS[event.kind][:2]
        if event.kind == EventKind.REWIND:
            step = event.get("spike_step")
            detail = f"spike at step {step}, back to step {event.get('to_step')}"
        else:
            step = event.get("step")
            detail = ""
        if not _is_int(step):
            # A pod failure names no step: place it at the step in flight when it was noticed.
            step = _step_at(event.time, records)
        if step is None:
            continue
        if event.kind in (EventKind.POD_FAILURE, EventKind.REJOIN) and event.get("pods") is not None:
            detail = f"pods {event.get('pods')}"
        if event.kind == EventKind.HOT_SWAP:
            detail = f"slot {event.get('slot')}: {event.get('old_address')} -> {event.get('new_address')}"
        markers.append({"kind": kind, "event": event.kind.value, "step": int(step), "label": label,
                        "detail": detail})
    return markers


def _cumulative(values) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def report_series(records: list[StepRecord], evals: list[dict], events: list[Event]) -> dict:
    """Everything the report plots, by name, from the step records and evaluation records
    (read_metrics, file order) and the events (read_events).

    - steps, loss, tokens (cumulative tokens at the end of each step), step_time, tokens_per_s, mfu,
      hfu (None where unknown): one entry per step, the step's last record;
    - eval: {steps, tokens, loss} of the evaluation records, the last of each step;
    - pods: {pod index: {steps, compute, exposed_exchange, update}}, from each record's `pods`
      (a pod that was out on a degraded step has no entry there);
    - degraded: [[first, last], ...] runs of steps with live_pods < len(hosts);
    - markers: [{kind, event, step, label, detail}] for failures, restores, rejoins, rewinds and
      checkpoints (saved or failed);
    - mfu_known, hfu_known: whether any step has the value (else the panel says n/a);
    - dcn_bytes: one entry per step, every pod's bytes put on the data plane in it (after
      compression): constant with every-step sync, 0 between DiLoCo's outer steps;
      dcn_bytes_mean: their mean per step (0.0 without steps);
    - outer: {steps, syncs, fragments, seconds, exposed_s} of the steps that applied a DiLoCo outer
      step (StepRecord.outer_sync set; none in an every-step run or a file from before DiLoCo)."""
    train = latest_by_step(records)
    steps = [r.step for r in train]
    tokens = _cumulative(r.tokens for r in train)
    evals = _latest_evals(evals)

    pods: dict[int, dict[str, list]] = {}
    for record in train:
        for entry in record.pods:
            pod = pods.setdefault(entry.pod, {"steps": [], **{name: [] for name, _, _ in PHASES}})
            pod["steps"].append(record.step)
            for name, field, _ in PHASES:
                pod[name].append(getattr(entry, field))

    mfu = [r.mfu for r in train]
    hfu = [r.hfu for r in train]
    dcn = [r.dcn_bytes_sent for r in train]
    outer = [r for r in train if r.outer_sync is not None]
    return {
        "steps": steps,
        "loss": [r.loss for r in train],
        "tokens": tokens,
        "step_time": [r.step_time_s for r in train],
        "tokens_per_s": [r.tokens_per_s for r in train],
        "mfu": mfu, "hfu": hfu,
        "mfu_known": any(v is not None for v in mfu), "hfu_known": any(v is not None for v in hfu),
        "eval": {"steps": [r["step"] for r in evals],
                 # An eval-only record between training steps sits at the tokens trained so far.
                 "tokens": [_tokens_until(r["step"], steps, tokens) for r in evals],
                 "loss": [float(r["eval_loss"]) for r in evals]},
        "pods": {p: pods[p] for p in sorted(pods)},
        "degraded": _degraded_spans(train),
        "markers": _markers(events, records),
        "dcn_bytes": dcn,
        "dcn_bytes_mean": sum(dcn) / len(dcn) if dcn else 0.0,
        "outer": {"steps": [r.step for r in outer], "syncs": [r.outer_sync for r in outer],
                  "fragments": [r.outer_fragment for r in outer], "seconds": [r.outer_seconds for r in outer],
                  "exposed_s": [r.outer_exposed_s for r in outer]},
    }


def _tokens_until(step: int, steps: list[int], tokens: list[float]) -> float:
    """The cumulative tokens at the end of the last training step at or before `step` (steps in order)."""
    index = bisect.bisect_right(steps, step)
    return tokens[index - 1] if index else 0.0


# -- drawing ---------------------------------------------------------------------------------------
def _nan(values) -> list[float]:
    return [math.nan if v is None else v for v in values]


def _events_on(ax, series: dict, seen: set | None = None) -> None:
    """Shade the degraded steps and draw the event lines on a panel whose x axis is the step."""
    for i, (first, last) in enumerate(series["degraded"]):
        ax.axvspan(first - 0.5, last + 0.5, color="tab:red", alpha=0.12, lw=0,
                   label="degraded (pods out)" if seen is not None and i == 0 else None)
    for marker in series["markers"]:
        _, label, colour, style = next(v for v in MARKERS.values() if v[0] == marker["kind"])
        show = seen is not None and marker["kind"] not in seen
        if show:
            seen.add(marker["kind"])
        ax.axvline(marker["step"], color=colour, ls=style, lw=1.2, alpha=0.8, label=label if show else None)


def _step_time_top(series: dict) -> float | None:
    """A y limit that keeps the first step (compilation, warm-up) from flattening the rest; None
    if it does not stand out."""
    later = [t for t in series["step_time"][1:] if t is not None and math.isfinite(t)]
    first = series["step_time"][0] if series["step_time"] else None
    if not later or first is None or not math.isfinite(first) or first <= 1.5 * max(later):
        return None
    return 1.4 * max(later)


def _byte_unit(top: float) -> tuple[str, int]:
    """The binary unit (name, size) that `top` bytes read best in."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= size:
            return unit, size
    return "B", 1


def _outer_ticks(ax, series: dict) -> None:
    """Short vertical ticks along the bottom of a step panel at DiLoCo's outer steps; nothing in a
    run without outer steps."""
    steps = series["outer"]["steps"]
    if steps:
        low, high = ax.get_ylim()
        ax.set_ylim(low - 0.06 * (high - low), high)    # a strip below the curves for the ticks
        ax.vlines(steps, 0.0, 0.05, transform=ax.get_xaxis_transform(), color=OUTER_COLOUR, lw=1.2,
                  label="outer step (DiLoCo)", gid=OUTER_GID)


def _dcn_panel(ax, series: dict) -> None:
    """Every pod's bytes on the DCN per step, as bars (an every-step run's make a band, DiLoCo's
    are spikes at its outer steps, drawn in the outer steps' colour), and their mean per step."""
    steps, sent = series["steps"], series["dcn_bytes"]
    top = max(sent, default=0)
    unit, size = _byte_unit(top)
    outer = set(series["outer"]["steps"])
    for at_outer, colour, label in ((False, "tab:blue", "bytes sent, all pods"),
                                    (True, OUTER_COLOUR, "outer step: bytes sent, all pods")):
        chosen = [(s, b / size) for s, b in zip(steps, sent) if (s in outer) == at_outer]
        if not chosen or not any(b for _, b in chosen):
            continue
        # Width 1 and an edge of the same colour: a band for every-step sync, and a spike that
        # stays visible at a pixel or less per step.
        bars = ax.bar(*zip(*chosen), width=1.0, color=colour, edgecolor=colour, lw=0.5, label=label)
        for bar in bars:
            bar.set_gid(DCN_GID)
    if top > 0:
        mean = series["dcn_bytes_mean"]
        ax.axhline(mean / size, color="black", ls="--", lw=1.0, label=f"mean: {mean / size:,.1f} {unit} per step")
        ax.set_ylim(0, 1.4 * top / size)        # room for the legend above the bars
        ax.legend(fontsize="small", loc="upper left", ncol=2)
    else:
        ax.set_ylim(0, 1)
        ax.text(0.5, 0.5, "no bytes on the DCN (one pod?)", ha="center", va="center", transform=ax.transAxes)
    _events_on(ax, series)
    ax.set(title="DCN bytes on the wire per step (every pod's, after compression)", xlabel="step",
           ylabel=f"{unit} per step")


def figure(series: dict):
    """The report's matplotlib Figure of `series` (from report_series), and its panels by name:
    loss, dcn, tokens, time, split, rate, util (in reading order: row by row, left to right).

    Panels: loss (and eval loss) against steps and against tokens; every pod's DCN bytes per step
    under the loss, sharing its steps, with DiLoCo's outer steps ticked on the loss; each pod's
    compute, exposed exchange and update time per step, and their medians stacked per pod;
    tokens/s; MFU and HFU. The step panels shade degraded steps and draw the events as vertical
    lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins, not layout="constrained": it measured every label's extent at each save, a
    # third of the drawing time (docs/benchmarks.md, the suite's time), for a layout that is the
    # same for every run.
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(HEIGHTS), 2, height_ratios=HEIGHTS, **MARGINS)
    loss_ax = fig.add_subplot(grid[0, 0])
    dcn_ax = fig.add_subplot(grid[1, 0], sharex=loss_ax)
    tokens_ax = fig.add_subplot(grid[0:2, 1])
    time_ax, split_ax = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    rate_ax, util_ax = fig.add_subplot(grid[3, 0]), fig.add_subplot(grid[3, 1])
    steps = series["steps"]
    evals = series["eval"]

    loss_ax.plot(steps, _nan(series["loss"]), color="tab:blue", lw=1.2, label="train loss")
    if evals["steps"]:
        loss_ax.plot(evals["steps"], _nan(evals["loss"]), "o-", color="tab:orange", ms=4, label="eval loss")
    _events_on(loss_ax, series, seen=set())
    _outer_ticks(loss_ax, series)
    loss_ax.set(title="loss by step", xlabel="step", ylabel="loss")
    loss_ax.legend(fontsize="small", loc="upper right")

    _dcn_panel(dcn_ax, series)

    tokens_ax.plot(series["tokens"], _nan(series["loss"]), color="tab:blue", lw=1.2, label="train loss")
    if evals["steps"]:
        tokens_ax.plot(evals["tokens"], _nan(evals["loss"]), "o-", color="tab:orange", ms=4, label="eval loss")
    tokens_ax.set(title="loss by tokens trained", xlabel="tokens", ylabel="loss")
    tokens_ax.legend(fontsize="small", loc="upper right")

    colours = {"compute": "tab:blue", "exposed_exchange": "tab:red", "update": "tab:green"}
    styles = ["-", "--", ":", "-."]
    time_ax.plot(steps, _nan(series["step_time"]), color="black", lw=1.0, alpha=0.6, label="step (controller)")
    for i, (pod, data) in enumerate(series["pods"].items()):
        for name, _, label in PHASES:
            time_ax.plot(data["steps"], data[name], color=colours[name], ls=styles[i % len(styles)], lw=1.0,
                         label=f"pod {pod} {label}")
    _events_on(time_ax, series)
    top = _step_time_top(series)
    finite = [t for t in series["step_time"] if t is not None and math.isfinite(t)]
    top = top if top is not None else 1.4 * max(finite, default=0.0)   # room for the legend
    if top > 0:
        time_ax.set_ylim(0, top)
    clipped = any(t > top for t in finite)
    time_ax.set(title="step time by phase, per pod" + (" (first step off scale)" if clipped else ""),
                xlabel="step", ylabel="seconds")
    time_ax.legend(fontsize="x-small", ncol=2, loc="upper right")

    # Medians over the steps after the first (which includes compilation), stacked per pod.
    names = [f"pod {pod}" for pod in series["pods"]]
    bottom = [0.0] * len(names)
    for name, _, label in PHASES:
        medians = [statistics.median(d[name][1:] or d[name]) if d[name] else 0.0 for d in series["pods"].values()]
        split_ax.bar(names, medians, bottom=bottom, color=colours[name], label=label)
        bottom = [b + m for b, m in zip(bottom, medians)]
    if any(bottom):
        split_ax.set_ylim(0, 1.3 * max(bottom))
    split_ax.set(title="median step time split per pod (first step left out)", ylabel="seconds")
    split_ax.legend(fontsize="small")

    rate_ax.plot(steps, _nan(series["tokens_per_s"]), color="tab:blue", lw=1.2)
    _events_on(rate_ax, series)
    rate_ax.set(title="tokens/s", xlabel="step", ylabel="tokens/s")

    parts = []
    for key, label, colour in (("mfu", "MFU", "tab:purple"), ("hfu", "HFU", "tab:brown")):
        if series[f"{key}_known"]:
            util_ax.plot(steps, [100 * v for v in _nan(series[key])], color=colour, lw=1.2, label=label)
            parts.append(label)
        else:
            parts.append(f"{label} n/a")
    if series["mfu_known"] or series["hfu_known"]:
        util_ax.legend(fontsize="small")
    else:
        util_ax.text(0.5, 0.5, "no peak FLOP/s known:\nrun `multipod peak-flops` or pass --peak-flops",
                     ha="center", va="center", transform=util_ax.transAxes)
    _events_on(util_ax, series)
    util_ax.set(title=", ".join(parts), xlabel="step", ylabel="% of peak")
    return fig, {"loss": loss_ax, "dcn": dcn_ax, "tokens": tokens_ax, "time": time_ax, "split": split_ax,
                 "rate": rate_ax, "util": util_ax}


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
