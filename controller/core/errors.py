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
