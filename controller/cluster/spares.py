"""Standby pods for hot-swap: workers started with `multipod worker --spare`, connected and checked
before they are needed, that take a failed pod's slot at a new address.

They come from `multipod train --spares ...` (checked when the run starts), from `multipod local
--spares N`, or from `multipod attach RUN_DIR --worker ADDR` while the run goes on: attach appends
the pod's addresses as a line of RUN_DIR/spares (the --workers @FILE format), and the pool reads
new lines every poll_s. A spare that does not fit is refused with the reason, by name, and the run
goes on without it: one that does not hold the run's secret (its first call fails), one that is not
a spare (it serves a pod index already, or is configured), or one whose pod has another number of
hosts or devices than the run's pods."""
from __future__ import annotations

import dataclasses
import fcntl
import pathlib
import threading
from collections.abc import Callable

from multipod.controller.cluster.api import PodApi
from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pod_client import make_pod_client
from multipod.controller.core.errors import RunError

SPARES_FILE = "spares"      # in the run directory: one spare pod per line, its hosts separated by ","


@dataclasses.dataclass(frozen=True)
class Spare:
    """One standby pod: its hosts' HOST:PORT, in host order."""
    hosts: tuple[str, ...]

    @property
    def name(self) -> str:
        return ",".join(self.hosts)

    def client(self, slot: int) -> PodApi:
        """A client that speaks to this pod as the pod of `slot`."""
        return make_pod_client(slot, list(self.hosts))


def offer(run_dir: pathlib.Path, hosts: list[str]) -> pathlib.Path:
    """Offer a standby pod to the run in `run_dir` (`multipod attach`): one line appended to its
    spares file, under a lock so that two offers never interleave. Returns the file."""
    if not hosts or any(not h or ":" not in h or "," in h for h in hosts):
        raise ValueError(f"a spare pod's hosts must each be HOST:PORT, got {hosts!r}")
    path = run_dir / SPARES_FILE
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(",".join(hosts) + "\n")
    return path


class SparePool:
    """The run's checked standby pods, first offered first taken. `check(spare)` raises (RunError
    or WorkerError) why a spare cannot serve; `on_refused(spare, why)` is told of every refusal
    (the controller prints it and writes an event)."""

    def __init__(self, check: Callable[[Spare], None], on_refused: Callable[[Spare, str], None],
                 run_dir: pathlib.Path | None = None, poll_s: float = 1.0):
        self._check, self._on_refused = check, on_refused
        self._ready: list[Spare] = []
        self._seen: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._file = run_dir / SPARES_FILE if run_dir is not None else None
        self._read_bytes = 0
        self._poll_lock = threading.Lock()      # the watcher's polls and take()'s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._file is not None:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="spares")
            self._thread.start()

    def add(self, hosts: list[str]) -> bool:
        """Check a standby pod and keep it if it fits; whether it was kept (a refusal is reported
        through on_refused). An address already offered is ignored."""
        spare = Spare(tuple(hosts))
        with self._lock:
            if spare.hosts in self._seen:
                return False
            self._seen.add(spare.hosts)
        try:
            self._check(spare)
        except (RunError, WorkerError) as exc:
            self._on_refused(spare, str(exc))
            return False
        with self._lock:
            self._ready.append(spare)
        return True

    def take(self) -> Spare | None:
        """The oldest checked spare (the pool forgets it), or None."""
        self.poll()
        with self._lock:
            return self._ready.pop(0) if self._ready else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)

    def poll(self) -> None:
        """Check the spares offered in the run directory's file since the last poll."""
        if self._file is None:
            return
        with self._poll_lock:
            self._poll()

    def _poll(self) -> None:
        assert self._file is not None
        try:
            with self._file.open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_SH)
                f.seek(self._read_bytes)
                text = f.read()
        except FileNotFoundError:
            return
        complete = text[:text.rfind(b"\n") + 1]       # a line still being written waits for the next poll
        self._read_bytes += len(complete)
        for line in complete.decode("utf-8", "replace").splitlines():
            hosts = line.split("#", 1)[0].replace(",", " ").split()
            if hosts:
                self.add(hosts)

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
