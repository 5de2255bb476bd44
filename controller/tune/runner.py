"""Running the grid of `multipod tune`: layout probes in child processes, deadlines, progress.

Every candidate is evaluated by the pod-side layout probe (`python -m
multipod.pod_worker.layout_probe`, a process boundary: the controller imports no pod code). The
parent sends it each candidate's WorkerConfig as JSON and reads one JSON message per line back
(the protocol is in pod_worker/layout_probe.py). One deadline covers starting jax and each
candidate. A probe that crashes or misses the deadline is killed, the failure is charged to the
candidate that was running (or, if none had started, the first one left), and the search goes on
with the remaining candidates in a fresh probe.

The loop (run_candidates) is shared with `multipod tune --inference` (controller/tune/inference.py),
whose inference probe speaks the same protocol with its own spec and result fields.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable

from multipod.controller.tune.grid import Candidate, candidate_worker_json
from multipod.controller.tune.table import mib

PROBE_MODULE = "multipod.pod_worker.layout_probe"


class ProbeProcess:
    """One layout-probe process; its stdout messages arrive on a queue."""

    def __init__(self, spec: dict, command: list[str] | None = None):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # the probe sets the pod's device count itself
        self.proc = subprocess.Popen(command or [sys.executable, "-m", PROBE_MODULE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.close()

    def _read(self):
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # stray output from a library
            if isinstance(message, dict) and "event" in message:
                self.lines.put(message)
        self.lines.put(None)

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-40]

    def next(self, timeout_s: float) -> dict | None:
        """The next message, None when the probe exited, or raises queue.Empty on timeout."""
        return self.lines.get(timeout=timeout_s)

    def tail(self) -> str:
        """The last few meaningful lines of the probe's stderr, on one line (once the probe has
        exited: all of it, the reader is waited for up to 5s)."""
        if self.proc.poll() is not None:
            self._stderr_reader.join(timeout=5)
        lines = [line.rstrip() for line in self.stderr if line.strip() and "Warning" not in line]
        return " | ".join(lines[-3:])

    def kill(self) -> None:
        """Stop the probe (if still running) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def row_summary(row: dict) -> str:
    """One line about a candidate's result, for the progress output."""
    if row["status"] == "ok":
        return f"{row['step_time_s'] * 1e3:.1f} ms/step, {mib(row.get('memory_bytes'))} MiB"
    if row["status"] == "over memory limit":
        return f"over the memory limit ({mib(row.get('memory_bytes'))} MiB)"
    return f"error: {row['error'][:200]}"


class Progress:
    """A progress bar on a terminal (stderr), else one plain stderr line per candidate; summary
    makes the line about a finished candidate's row."""

    def __init__(self, total: int, summary: Callable[[dict], str] = row_summary):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
        self.console = Console(stderr=True)
        self.total = total
        self.summary = summary
        self.progress = None
        if self.console.is_terminal:
            self.progress = RichProgress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(),
                                         TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=self.console)
            self.task = self.progress.add_task("tune", total=total, what="starting")
            self.progress.start()

    def start(self, done: int, candidate: Candidate) -> None:
        """A candidate started; `done` candidates are finished."""
        if self.progress is not None:
            self.progress.update(self.task, completed=done, what=f"compiling + timing {candidate.label()}")
        else:
            print(f"[{done + 1}/{self.total}] {candidate.label()} ...", file=sys.stderr, flush=True)

    def finish(self, done: int, candidate: Candidate, row: dict) -> None:
        """A candidate finished (ran, went over the limit, or failed); `done` are finished now."""
        summary = self.summary(row)
        if self.progress is not None:
            self.progress.update(self.task, completed=done)
            self.progress.console.print(f"  {candidate.label()}: {summary}")
        else:
            print(f"[{done}/{self.total}] {candidate.label()}: {summary}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the live bar (if any)."""
        if self.progress is not None:
            self.progress.stop()


def _run_probe(probe: ProbeProcess, candidates: list, rows: dict[int, dict], info: dict,
               progress: Progress, timeout_s: float) -> tuple[str | None, int | None]:
    """Read one probe's messages into rows/info until it is done (None, None), or fails: then
    (the error, the index of the candidate that was running or None)."""
    current = None
    while True:
        try:
            message = probe.next(timeout_s)  # starting jax takes a while too; the same deadline covers it
        except queue.Empty:
            what = "starting the tuning process" if current is None else "this candidate"
            return f"timed out: {what} took more than {timeout_s:g}s", current
        if message is None:
            probe.proc.wait(timeout=30)
            tail = probe.tail()
            return (f"the tuning process died (exit code {probe.proc.returncode})"
                    + (f": {tail}" if tail else "")), current
        event = message.pop("event")
        if event == "ready":
            info.clear()
            info.update(message)
        elif event == "start":
            current = message["index"]
            progress.start(len(rows), candidates[current])
        elif event == "result":
            index = message.pop("index")
            rows[index] = message
            progress.finish(len(rows), candidates[index], message)
            current = None
        elif event == "done":
            return None, None


def run_candidates(candidates: list, payloads: list, spec: dict, timeout_s: float, command: list[str] | None = None,
                   summary: Callable[[dict], str] = row_summary) -> tuple[list[dict], dict]:
    """Evaluate every candidate in probes speaking the layout probe's protocol; one result per
    candidate, in grid order, and the probe's device info ({'device_kind', 'num_devices'}, empty if
    no probe ever started).

    candidates: anything with .label() (for the progress output); payloads: what the probe gets for
    each candidate; spec: the probe's stdin spec but its "candidates" (filled in here with the ones
    still pending); command: the probe's command line (default: the layout probe); summary: the
    progress line about a finished row."""
    rows: dict[int, dict] = {}
    info: dict = {}
    progress = Progress(len(candidates), summary)
    pending = list(range(len(candidates)))
    try:
        while pending:
            probe = ProbeProcess({**spec, "candidates": [(i, payloads[i]) for i in pending]}, command)
            try:
                error, current = _run_probe(probe, candidates, rows, info, progress, timeout_s)
            finally:
                probe.kill()
            if error is None and any(i not in rows for i in pending):
                error, current = "the tuning process finished without a result for this candidate", None
            if error is not None:
                victim = current if current is not None else next((i for i in pending if i not in rows), None)
                if victim is not None:   # None: the probe failed after its last result; nothing to charge
                    rows[victim] = {"status": "error", "error": error}
                    progress.finish(len(rows), candidates[victim], rows[victim])
            pending = [i for i in pending if i not in rows]
    finally:
        progress.close()
    return [rows[i] for i in range(len(candidates))], info


def run_grid(config, candidates: list[Candidate], devices: int, per_pod_batch: int, steps: int,
             memory_limit: int | None, timeout_s: float, command: list[str] | None = None) -> tuple[list[dict], dict]:
    """Evaluate every candidate in layout probes; one result per candidate, in grid order, and
    the probe's device info ({'device_kind', 'num_devices'}, empty if no probe ever started).

    config: the run's controller.config.Config; each candidate is applied to it and sent as the
    pod's WorkerConfig JSON. command overrides the probe's command line (tests)."""
    payloads = [candidate_worker_json(config, c) for c in candidates]
    spec = {"devices": devices, "per_pod_batch": per_pod_batch, "steps": steps, "memory_limit": memory_limit}
    return run_candidates(candidates, payloads, spec, timeout_s, command)
