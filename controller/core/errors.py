"""The run's error types: what stops a run, and what a recovery can fix."""
from __future__ import annotations


class RunError(RuntimeError):
    """The run cannot go on; the message says why and names the pods and step involved."""


class PodFailure(RunError):
    """A pod died, hung or failed a step: recoverable by restoring every pod to the last
    checkpoint. `pods` are the pods found unresponsive (empty if none could be singled out);
    `hung` those among them that are alive but silent (a dead pod's health check is refused)."""

    def __init__(self, message: str, pods=(), hung=()):
        super().__init__(message)
        self.pods = tuple(pods)
        self.hung = tuple(hung)


class Divergence(RunError):
    """After `step` the pods' state checksums differ (silent data corruption on some pod, most
    likely). `checksums`: {pod: its checksum}; `outvoted`: the pods whose checksum differs from a
    strict majority's (empty when there is none: two pods, or no checksum held by more than half)."""

    def __init__(self, step: int, checksums: dict[int, str]):
        self.step, self.checksums = step, dict(checksums)
        counts: dict[str, int] = {}
        for value in self.checksums.values():
            counts[value] = counts.get(value, 0) + 1
        top, votes = max(counts.items(), key=lambda item: item[1])
        self.majority = top if votes * 2 > len(self.checksums) else None
        self.outvoted = tuple(sorted(p for p, c in self.checksums.items() if self.majority is not None and c != top))
        detail = ", ".join(f"pod {p}: {c}" for p, c in sorted(self.checksums.items()))
        if self.majority is not None:
            why = f"pod(s) {list(self.outvoted)} differ from the majority"
        else:
            why = (f"no majority among {len(self.checksums)} pods tells which state is right"
                   + (" (two pods)" if len(self.checksums) == 2 else ""))
        super().__init__(f"step {step}: pods diverged, their state checksums differ ({detail}): {why}")
