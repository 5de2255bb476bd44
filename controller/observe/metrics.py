"""What the run tells the user: metrics.jsonl and TensorBoard events in the run directory, and a
live progress line on the terminal."""
from __future__ import annotations

import json
import math
import os
import pathlib
import queue
import sys
import threading
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from multipod.controller.observe.events import open_appending
from multipod.controller.observe.records import PodTimings, StepRecord


def peak_cache() -> pathlib.Path:
    """Where `multipod peak-flops` keeps its measurements (MULTIPOD_PEAK_FILE overrides)."""
    override = os.environ.get("MULTIPOD_PEAK_FILE")
    return pathlib.Path(override) if override else pathlib.Path.home() / ".cache" / "multipod" / "peak_flops.json"


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float | None,
        num_devices: int) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak; None if no peak."""
    if not peak_flops_per_device or num_devices <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)


@dataclass(frozen=True)
class Accounting:
    """What turns a step's tokens and time into FLOP/s and utilisation."""
    model_flops_per_token: float
    peak_flops: float | None = None     # per device; None: unknown (MFU and HFU are None)
    num_devices: int = 1                # over all pods
    hardware_flops_per_step: float = 0.0  # XLA's count for the whole step over all pods; 0: unknown


def _shards(replies) -> list:
    """Every shard's result (ShardResult) in slot order; the replies themselves if they carry none."""
    shards = [s for r in replies for s in r.shards]
    return sorted(shards, key=lambda s: s.slot) if shards else list(replies)


def step_record(step: int, replies, step_time_s: float, accounting: Accounting, *, hosts: list[int] | None = None,
                data_index: int, epoch: float, skipped_steps: int, restarts: int, hot_swaps: int = 0,
                partial_loss: bool = False) -> StepRecord:
    """The record of one step from every live pod's StepReply: the loss over all shards' tokens
    (summed in slot order, so a degraded step reports the very loss a healthy one would), the
    slowest pod's phase timings, throughput, MFU/HFU (None without a peak), which pod computed
    which shard (`hosts`, by slot; None: each pod its own), and where the step stands in the run
    (data_index, epoch, skipped_steps, restarts, hot_swaps, partial_loss: see StepRecord)."""
    shards = _shards(replies)
    tokens = sum(r.tokens for r in shards)
    tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
    flops_per_token, peak, devices = accounting.model_flops_per_token, accounting.peak_flops, accounting.num_devices
    # Hardware FLOPs: XLA's count of what the pods' compiled steps execute, recompute included.
    hw_step = accounting.hardware_flops_per_step
    hw_per_token = hw_step / tokens if hw_step and tokens else None
    pods = tuple(PodTimings(pod=r.pod_index, compute_s=r.timings.compute_s, exchange_s=r.timings.exchange_s,
                            exposed_exchange_s=r.timings.exposed_exchange_s, update_s=r.timings.update_s,
                            wait_s=r.timings.wait_s, checksum_s=r.timings.checksum_s,
                            fingerprint_s=r.timings.fingerprint_s, idle_s=r.timings.idle_s,
                            peer_wait_s=r.timings.peer_wait_s, wire_wait_s=r.timings.wire_wait_s,
                            dcn_bytes_sent=r.dcn_bytes_sent, dcn_packed=r.dcn_packed) for r in replies)
    return StepRecord(
        step=step, loss=sum(r.loss_sum for r in shards) / tokens, z_loss=sum(r.z_loss_sum for r in shards) / tokens,
        hosts=tuple(hosts) if hosts is not None else tuple(range(len(replies))), live_pods=len(replies),
        grad_norm=replies[0].grad_norm, learning_rate=replies[0].learning_rate, skipped=replies[0].skipped,
        checksums=tuple(r.checksum for r in replies),
        fingerprints=tuple(r.fingerprint for r in replies) if any(r.fingerprint for r in replies) else None,
        step_time_s=step_time_s,
        # The step waits for the slowest pod in each phase.
        compute_time_s=max(p.compute_s for p in pods), exchange_time_s=max(p.exchange_s for p in pods),
        update_time_s=max(p.update_s for p in pods), idle_time_s=max(p.idle_s for p in pods),
        exposed_exchange_s=max(p.exposed_exchange_s for p in pods),
        checksum_time_s=max(p.checksum_s for p in pods), fingerprint_time_s=max(p.fingerprint_s for p in pods),
        pods=pods, dcn_bytes_sent=sum(p.dcn_bytes_sent for p in pods),
        tokens=tokens, tokens_per_s=tokens_per_s, model_flops_per_token=flops_per_token,
        mfu=mfu(tokens_per_s, flops_per_token, peak, devices), hardware_flops_per_token=hw_per_token,
        hfu=mfu(tokens_per_s, hw_per_token, peak, devices) if hw_per_token else None, time=time.time(),
        data_index=data_index, epoch=epoch, skipped_steps=skipped_steps, restarts=restarts,
        hot_swaps=hot_swaps, partial_loss=partial_loss, **_outer_fields(replies))


def _outer_fields(replies) -> dict:
    """A DiLoCo outer step's StepRecord fields, from the replies that report it (every pod applies
    it at the same step); none if the step applied none."""
    outer = [r.outer for r in replies if r.HasField("outer")]
    if not outer:
        return {}
    return {"outer_sync": outer[0].sync, "outer_fragment": outer[0].fragment,
            "outer_seconds": max(o.seconds for o in outer), "outer_exposed_s": max(o.exposed_s for o in outer),
            "outer_pods": tuple(outer[0].pods)}


def load_measured_peak(device_kind: str, num_devices: int) -> float | None:
    """Per-device peak recorded by `multipod peak-flops` for this device kind and count."""
    try:
        records = json.loads(peak_cache().read_text())
    except (OSError, ValueError):
        return None
    record = records.get(f"{device_kind}/{num_devices}") if isinstance(records, dict) else None
    return float(record["per_device_flops"]) if record else None


def store_measured_peak(device_kind: str, num_devices: int, per_device_flops: float) -> pathlib.Path:
    """Remember a `multipod peak-flops` measurement for this device kind and count."""
    records = {}
    try:
        records = json.loads(peak_cache().read_text())
    except (OSError, ValueError):
        pass
    records[f"{device_kind}/{num_devices}"] = {"per_device_flops": per_device_flops,
                                               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = peak_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2))
    return path


class MetricsLog:
    """One JSON object per step (StepRecord.to_json) and per evaluation in metrics.jsonl, mirrored
    as TensorBoard scalars.

    TensorBoard events are written on a thread of their own: tensorboardX hands them to a
    multiprocessing queue, and a Ctrl-C that lands inside that hand-off (it always lands on the
    main thread) left the queue unable to close, so the run hung on exit. Closing waits at most
    TB_CLOSE_TIMEOUT_S; the jsonl is the record either way."""

    TB_CLOSE_TIMEOUT_S = 10.0

    def __init__(self, run_dir: pathlib.Path, append: bool = False):
        self.path = run_dir / "metrics.jsonl"
        self._file = open_appending(self.path) if append else self.path.open("w")
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_events, args=(run_dir / "tensorboard",), daemon=True,
                                        name="tensorboard")
        self._thread.start()

    def _write_events(self, directory: pathlib.Path) -> None:
        try:
            from tensorboardX import SummaryWriter
            writer = SummaryWriter(str(directory))
        except Exception:  # TensorBoard events are a convenience; the jsonl is the record
            writer = None
        while (record := self._queue.get()) is not None:
            if writer is None:
                continue
            for key, value in record.items():
                scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
                if scalar and math.isfinite(value) and key != "step":
                    writer.add_scalar(key, value, record["step"])
        if writer is not None:
            writer.close()

    def write(self, record: StepRecord) -> None:
        """One step's line."""
        self._write(record.to_dict())

    def write_eval(self, record: dict) -> None:
        """One evaluation's line (controller/components/evaluation.py)."""
        self._write(record)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._queue.put(record)

    def close(self) -> None:
        self._file.close()
        self._queue.put(None)
        self._thread.join(self.TB_CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            out(f"warning: TensorBoard events not flushed within {self.TB_CLOSE_TIMEOUT_S:g}s; metrics.jsonl is "
                f"complete")


class Recorder:
    """Where finished steps go: metrics.jsonl, the progress line, and the records by step (a step
    replayed after a recovery or rewind replaces its earlier record). `sink` and `progress` are
    anything with write(record), write_eval(record) / update(record), note(record) and close()."""

    def __init__(self, sink, progress):
        self.sink, self.progress = sink, progress
        self.records: dict[int, StepRecord] = {}
        self.skipped_steps: set[int] = set()
        self.steps_written = 0      # records written, replays included (lost steps = this - distinct steps)

    def note_skipped(self, step: int, skipped: bool) -> int:
        """Track steps whose update was skipped; returns how many there are so far."""
        if skipped:
            self.skipped_steps.add(step)
        return len(self.skipped_steps)

    def write(self, record: StepRecord) -> None:
        """Log, show and keep one step's record."""
        self.sink.write(record)
        self.steps_written += 1
        self.records[record.step] = record
        self.progress.update(record)

    def write_eval(self, record: dict) -> None:
        """Log and show an evaluation's record (it sits beside the step records, not among them)."""
        self.sink.write_eval(record)
        self.progress.note(record)

    def in_order(self) -> list[StepRecord]:
        """The latest record of every step, by step."""
        return [self.records[s] for s in sorted(self.records)]

    def close(self) -> None:
        self.progress.close()
        self.sink.close()


def _fmt(value, spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


class ProgressLine:
    """A live line (step, loss, tokens/s, MFU) on a terminal; periodic plain lines otherwise."""

    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None):
        self.console = console or Console(stderr=False)
        self.live = self.console.is_terminal
        self.total = total_steps
        self._last_print = 0.0
        self._progress = None
        if self.live:
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                                      console=self.console)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 stats="compiling...")
            self._progress.start()

    def update(self, record: StepRecord) -> None:
        live, slots = record.live_pods, len(record.hosts)
        degraded = f"  degraded {live}/{slots} pods" if live < slots else ""
        swapped = f"  hot-swapped {record.hot_swaps}" if record.hot_swaps else ""
        stats = (f"loss {record.loss:.4f}  {record.tokens_per_s:,.0f} tok/s  "
                 f"MFU {_fmt(record.mfu, '.1%')}  HFU {_fmt(record.hfu, '.1%')}  "
                 f"step {record.step_time_s:.2f}s  epoch {record.epoch:.2f}{degraded}{swapped}")
        # A pod failed, rejoined or was replaced by a spare: say so at once.
        changed = (live, record.hot_swaps) != getattr(self, "_membership", (live, record.hot_swaps))
        self._membership = (live, record.hot_swaps)
        if self._progress is not None:
            self._progress.update(self._task, completed=record.step + 1, stats=stats)
        elif time.monotonic() - self._last_print > 5 or record.step + 1 == self.total or changed:
            self._last_print = time.monotonic()
            print(f"step {record.step + 1}/{self.total}  {stats}", flush=True)

    def note(self, record: dict) -> None:
        """An evaluation's result, as a line of its own above the live line."""
        bpb = record.get("eval_bits_per_byte")
        line = (f"eval after step {record['trained_steps']}: loss {record['eval_loss']:.4f}  "
                f"perplexity {record['eval_perplexity']:.2f}" + (f"  {bpb:.3f} bits/byte" if bpb is not None else ""))
        if self._progress is not None:
            self._progress.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

    def print(self, *args, **kwargs) -> None:
        self.console.print(*args, **kwargs)


def out(message: str) -> None:
    """A plain status line for the user."""
    print(message, file=sys.stdout, flush=True)
