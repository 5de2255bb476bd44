"""Standby pods for hot-swap: workers started with `multipod worker --spare`, connected and checked
before they are needed, that take a failed pod's slot at a new address.

They come from `multipod train --spares ...`, from `multipod local --spares N`, or from `multipod
attach RUN_DIR --worker ADDR` while the run goes on: attach appends the pod's addresses as a line
of RUN_DIR/spares (the --workers @FILE format), and the pool reads new lines every poll_s. A spare
that fits compiles the run's programs on standby (Configure with standby) while it waits, so that
taking a slot costs no compile. A spare that does not fit is refused with the reason, by name, and the run
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
from multipod.protos.cli_flags import host_port_problem

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
    if not hosts or any("," in h or host_port_problem(h) for h in hosts):
        raise ValueError(f"a spare pod's hosts must each be HOST:PORT, got {hosts!r}")
    path = run_dir / SPARES_FILE
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(",".join(hosts) + "\n")
    return path


class SparePool:
    """The run's standby pods, first ready first taken. `check(spare)` raises (RunError or
    WorkerError) why a spare cannot serve, at once; `prepare(spare)` then readies it in the
    background (the controller has it compile the run's programs) and may raise the same.
    `on_refused(spare, why)` and `on_ready(spare)` are told of each outcome (the controller prints
    it and writes an event). Offers (offer(), and lines new in the run directory's spares file)
    are checked when the pool is made and then every poll_s on its own thread; `poll()` does one
    round at once."""

    def __init__(self, check: Callable[[Spare], None], on_refused: Callable[[Spare, str], None],
                 on_ready: Callable[[Spare], None] = lambda spare: None,
                 prepare: Callable[[Spare], None] | None = None, run_dir: pathlib.Path | None = None,
                 poll_s: float = 1.0, offers: list[list[str]] = ()):
        self._check, self._prepare = check, prepare
        self._on_refused, self._on_ready = on_refused, on_ready
        self._ready: list[Spare] = []
        self._offered: list[list[str]] = [list(hosts) for hosts in offers]
        self._seen: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()      # one round of checks at a time
        self._file = run_dir / SPARES_FILE if run_dir is not None else None
        self._read_bytes = 0
        self._stop = threading.Event()
        self.poll()      # the spares given up front, and those offered before the run began, checked now
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="spares")
        self._thread.start()

    def offer(self, hosts: list[str]) -> None:
        """A standby pod, to be checked at the pool's next round."""
        with self._lock:
            self._offered.append(list(hosts))

    def add(self, hosts: list[str]) -> bool:
        """Check a standby pod now; whether it passed (a refusal is reported through on_refused).
        It is ready at once, or once `prepare` succeeds on a thread of its own. An address
        already offered is ignored."""
        spare = Spare(tuple(hosts))
        with self._lock:
            if spare.hosts in self._seen:
                return False
            self._seen.add(spare.hosts)
        problems = [problem for problem in map(host_port_problem, hosts) if problem]
        if problems:     # a line written into the spares file by hand, say: refused now, not after a deadline
            if not self._stop.is_set():
                self._on_refused(spare, "; ".join(problems))
            return False
        if not self._outcome(spare, self._check):
            return False
        if self._prepare is None:
            self._keep(spare)
        else:
            threading.Thread(target=lambda: self._outcome(spare, self._prepare) and self._keep(spare),
                             daemon=True, name=f"spare-{spare.name}").start()
        return True

    def _outcome(self, spare: Spare, step: Callable[[Spare], None]) -> bool:
        try:
            step(spare)
            return True
        except (RunError, WorkerError) as exc:
            if not self._stop.is_set():
                self._on_refused(spare, str(exc))
            return False

    def _keep(self, spare: Spare) -> bool:
        if self._stop.is_set():
            return False
        with self._lock:
            self._ready.append(spare)
        self._on_ready(spare)
        return True

    def take(self) -> Spare | None:
        """The oldest checked spare (the pool forgets it), or None."""
        with self._lock:
            return self._ready.pop(0) if self._ready else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)

    def poll(self) -> None:
        """Check the spares offered (offer) and those added to the run directory's file since
        the last round."""
        with self._poll_lock:
            with self._lock:
                offered, self._offered = self._offered, []
            for hosts in offered + self._read_file():
                if self._stop.is_set():
                    return
                self.add(hosts)

    def _read_file(self) -> list[list[str]]:
        if self._file is None:
            return []
        try:
            with self._file.open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_SH)
                f.seek(self._read_bytes)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[:text.rfind(b"\n") + 1]       # a line still being written waits for the next round
        self._read_bytes += len(complete)
        lines = (line.split("#", 1)[0].replace(",", " ").split()
                 for line in complete.decode("utf-8", "replace").splitlines())
        return [hosts for hosts in lines if hosts]

    def _watch(self, poll_s: float) -> None:
        self.poll()
        while not self._stop.wait(poll_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
