"""Fault injection for tests, outside the production config: the worker reads it from its
environment here and nowhere else, and it is never part of the config or its hash.

MULTIPOD_TEST_NAN_GRADIENT="POD:STEP" makes pod POD's gradient NaN at step STEP, so tests can
exercise skip-on-non-finite without a real divergence.

MULTIPOD_TEST_HANG="POD:STEP" makes pod POD's worker stop itself (SIGSTOP) when it is asked to
run step STEP: a hung pod at a step of the test's choosing, not at whatever step the test's
process happened to reach. A restarted worker rejoins past that step, so it does not hang again.

Tests set them on the process that starts the workers (LocalPods passes its environment on).
"""
from __future__ import annotations

import os
import signal

import numpy as np

NAN_GRADIENT_ENV = "MULTIPOD_TEST_NAN_GRADIENT"
HANG_ENV = "MULTIPOD_TEST_HANG"


def _pod_step(name: str, pod_index: int, step: int) -> bool:
    value = os.environ.get(name, "")
    if not value:
        return False
    try:
        pod, at = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{name} must look like POD:STEP, got {value!r}") from None
    return pod == pod_index and at == step


def nan_gradient_at(pod_index: int, step: int) -> bool:
    """Whether the test hook asks for a NaN gradient on this pod at this step."""
    return _pod_step(NAN_GRADIENT_ENV, pod_index, step)


def hang_if_asked(pod_index: int, step: int) -> None:
    """Stop this process (SIGSTOP) if the test hook asks this pod to hang at this step."""
    if _pod_step(HANG_ENV, pod_index, step):
        os.kill(os.getpid(), signal.SIGSTOP)


def poison(grads: list) -> list:
    """The gradient leaves with the first one replaced by NaN (device arrays, or anything numpy
    reads: host arrays, a host's block of a leaf)."""
    grads = list(grads)
    first = grads[0]
    on_device = hasattr(first, "devices")      # a jax.Array: poisoned where it lives
    grads[0] = first * np.float32(np.nan) if on_device else np.full_like(np.asarray(first), np.nan)
    return grads


def poisoned(all_reduce):
    """An all_reduce for PodTrainer.train_step that poisons this pod's gradient before summing it
    (all_reduce None: a single pod, whose sum is its own gradient)."""
    def run(grads, **kwargs):
        grads = poison(grads)
        return all_reduce(grads, **kwargs) if all_reduce is not None else (grads, None)
    return run
