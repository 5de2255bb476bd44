"""The picture of `multipod report`: the series of report_series.py, and only those, plotted on
one matplotlib Figure (a test can look at its artists).

matplotlib is imported inside `figure` only (Agg canvas, no display needed): building the
`multipod` argument parser must stay free of it.
"""
from __future__ import annotations

import math
import statistics

from multipod.controller.observe.report_series import MARKERS, PHASES

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
