"""What `multipod report` plots, as named series: a pure function from the parsed lines
(StepRecord, evaluation records, Event; report_input.py) to plain lists and dicts, so that a test
can check what is plotted without reading pixels."""
from __future__ import annotations

import bisect

from multipod.controller.observe.events import Event, EventKind
from multipod.controller.observe.records import StepRecord
from multipod.controller.observe.report_input import is_int

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
    EventKind.REALIGNED: ("realigned", "survivors realigned: restored", "tab:purple", ":"),
    EventKind.REWIND: ("rewind", "loss-spike rewind", "tab:orange", "--"),
    EventKind.CHECKPOINT_SAVED: ("checkpoint", "checkpoint saved", "tab:gray", ":"),
    EventKind.CHECKPOINT_FAILED: ("checkpoint_failed", "checkpoint FAILED", "black", "--"),
}


def _num(value) -> float | None:
    """A finite-or-not float from a JSON number; None for null or anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


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
        if not is_int(step):
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
