"""What `multipod tune` reports: the ranked table, its JSON form, and the best layout's config file.

Rows are the candidates that ran, fastest first, then those over the memory limit, then the
errors (kept, with their message). MFU and HFU come from the one utilisation formula,
controller.metrics.mfu: MFU with the model's FLOPs per token, HFU with the hardware FLOPs per token
XLA counted for the compiled step (recomputation included).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import tomli_w

from multipod.controller.observe.metrics import mfu

STATUS_ORDER = {"ok": 0, "over memory limit": 1, "error": 2}


def mib(value) -> str:
    """Bytes as MiB with two decimals; 'n/a' for None."""
    return "n/a" if value is None else f"{value / 2**20:.2f}"


def rank(candidates: list, results: list[dict], flops_per_token: float, tokens_per_step: int,
         peak: float | None, devices: int) -> list[dict]:
    """Table rows: the candidates that ran, fastest first, then over-limit ones, then errors.

    results[i] is the probe's result for candidates[i]; flops_per_token is the model's (training)
    FLOPs per token; tokens_per_step the pod's tokens per step; peak the per-device peak FLOP/s
    (None: MFU and HFU are None). Ranks are 1, 2, ... for the rows that ran, None otherwise."""
    table = []
    for candidate, result in zip(candidates, results):
        row = {"mesh": f"{candidate.data}x{candidate.model}", **dataclasses.asdict(candidate), **result}
        row.setdefault("error", None)
        step = row.get("step_time_s")
        hw = row.get("hardware_flops_per_step")
        tokens_per_s = tokens_per_step / step if step else None
        row["tokens_per_s"] = tokens_per_s
        row["model_flops_per_step"] = flops_per_token * tokens_per_step
        row["mfu"] = mfu(tokens_per_s, flops_per_token, peak, devices) if tokens_per_s else None
        row["hfu"] = mfu(tokens_per_s, hw / tokens_per_step, peak, devices) if tokens_per_s and hw else None
        table.append(row)
    table.sort(key=lambda r: (STATUS_ORDER[r["status"]], r.get("step_time_s") or math.inf, r.get("memory_bytes") or 0))
    for position, row in enumerate(table, 1):
        row["rank"] = position if row["status"] == "ok" else None
    return table


def best_row(table: list[dict]) -> dict | None:
    """The fastest row that ran, or None."""
    return next((row for row in table if row["status"] == "ok"), None)


def print_table(table: list[dict], title: str) -> None:
    """The ranked table on stdout (rich), one line per candidate, errors in full."""
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for name in ("#", "mesh", "sp", "micro", "remat", "memory MiB", "step ms", "tokens/s", "MFU", "HFU", "status"):
        t.add_column(name, justify="right" if name not in ("remat", "status") else "left")

    def pct(value):
        return "n/a" if value is None else f"{value:.1%}"

    for row in table:
        t.add_row(str(row["rank"] or "-"), row["mesh"], "on" if row["sequence_parallel"] else "off",
                  str(row["microbatches"]), row["remat"], mib(row.get("memory_bytes")),
                  "-" if row.get("step_time_s") is None else f"{row['step_time_s'] * 1e3:.1f}",
                  "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}",
                  pct(row["mfu"]), pct(row["hfu"]),
                  row["status"] if row["status"] != "error" else f"error: {row['error']}")
    Console(width=200).print(t)


def write_report(path: str | pathlib.Path, table: list[dict], **context) -> None:
    """The table as JSON: the context (devices, pods, peak, ...), the rank of the best row, the rows."""
    best = best_row(table)
    report = {**context, "best": None if best is None else best["rank"], "rows": table}
    pathlib.Path(path).write_text(json.dumps(report, indent=2) + "\n")


def config_toml(config, header: list[str]) -> str:
    """The whole config (every section, every key) as TOML that `--config` accepts, after the
    header lines as `# ` comments."""
    comments = "".join(f"# {line}\n" for text in header for line in text.splitlines() or [""])
    return comments + "\n" + tomli_w.dumps(config.to_dict())


def write_config(path: str | pathlib.Path, config, header: list[str]) -> None:
    """Write config_toml(config, header) to path, and check it loads back as the same config."""
    from multipod.controller.core.run_config import load_config
    path = pathlib.Path(path)
    path.write_text(config_toml(config, header))
    loaded = load_config(str(path))
    if loaded != config:
        raise RuntimeError(f"{path} does not load back as the config it was written from")
