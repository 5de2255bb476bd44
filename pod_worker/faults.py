"""Fault injection for tests, outside the production config: the worker reads it from its
environment here and nowhere else, and it is never part of the config or its hash.

MULTIPOD_TEST_NAN_GRADIENT="POD:STEP" makes pod POD's gradient NaN at step STEP, so tests can
exercise skip-on-non-finite without a real divergence.

MULTIPOD_TEST_HANG="POD:STEP" makes pod POD's worker stop itself (SIGSTOP) when it is asked to
run step STEP: a hung pod at a step of the test's choosing, not at whatever step the test's
process happened to reach. A restarted worker rejoins past that step, so it does not hang again.

MULTIPOD_TEST_FLIP_BIT="POD:STEP" flips one bit of one parameter on pod POD right after step
STEP's update, once per worker process: silent data corruption, for the pods' state vote and the
controller's majority to catch (docs/reliability.md).

MULTIPOD_TEST_GATHER_TO_ONE="POD:EXCHANGE:MARKER" makes pod POD, in the all-gather of exchange
EXCHANGE (more than 2 pods, healthy; a DiLoCo outer exchange is keyed by its outer sync number),
send its reduced slices to its first peer only, wait until they have left, and kill itself
(SIGKILL): an exchange that reached one survivor and not the other. It fires once per file: it
creates MARKER, and does nothing where MARKER exists, so the restarted worker does not die again.

Tests set them on the process that starts the workers (LocalPods passes its environment on).
"""
from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time

import numpy as np

NAN_GRADIENT_ENV = "MULTIPOD_TEST_NAN_GRADIENT"
HANG_ENV = "MULTIPOD_TEST_HANG"
FLIP_BIT_ENV = "MULTIPOD_TEST_FLIP_BIT"
GATHER_TO_ONE_ENV = "MULTIPOD_TEST_GATHER_TO_ONE"
log = logging.getLogger(__name__)
_flipped: set[tuple[int, int]] = set()      # (pod, step) flipped in this process: a replay does not flip again


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
        # In the log first (a test that fails shows where the pod stopped), flushed: nothing
        # written after the stop reaches the file.
        log.warning("test hook: pod %d stops itself (SIGSTOP) as step %d begins", pod_index, step)
        for handler in logging.getLogger().handlers:
            handler.flush()
        # At this thread, not the process: a process-directed SIGSTOP is taken by whichever
        # thread the kernel picks, and until that one runs this thread goes on. On a loaded
        # machine it ran a whole tiny step and sent its gradient first (CI's lost step 40).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


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


def flip_bit_at(pod_index: int, step: int) -> bool:
    """Whether the test hook asks this pod to flip a parameter bit after this step (once)."""
    if (pod_index, step) in _flipped or not _pod_step(FLIP_BIT_ENV, pod_index, step):
        return False
    _flipped.add((pod_index, step))
    return True


def flip_bit(params) -> tuple[object, str]:
    """(params with the lowest bit of the first value of the first leaf flipped, that leaf's
    path): the smallest corruption there is, the kind a faulty chip or memory makes."""
    import jax

    from multipod.pod_worker.hosts import host_value
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    path, leaf = flat[0]
    values = np.array(host_value(leaf))
    bits = values.reshape(-1).view(np.dtype(f"u{values.dtype.itemsize}"))
    bits[0] ^= 1
    flipped = jax.make_array_from_callback(values.shape, leaf.sharding, lambda index: values[index])
    leaves = [flipped] + [value for _, value in flat[1:]]
    return jax.tree_util.tree_unflatten(treedef, leaves), jax.tree_util.keystr(path)


def gather_to_one_at(pod_index: int, exchange: int) -> bool:
    """Whether the test hook asks this pod to all-gather exchange `exchange` to its first peer
    only and die (and has not fired yet: its marker file does not exist; it is created here)."""
    value = os.environ.get(GATHER_TO_ONE_ENV, "")
    if not value:
        return False
    try:
        pod, at, marker = value.split(":", 2)
        fires = int(pod) == pod_index and int(at) == exchange
    except ValueError:
        raise ValueError(f"{GATHER_TO_ONE_ENV} must look like POD:EXCHANGE:MARKER, got {value!r}") from None
    if not fires or pathlib.Path(marker).exists():
        return False
    pathlib.Path(marker).write_text(f"pod {pod_index}, exchange {exchange}\n")
    return True


def die_once_sent(outbox, peer: int, timeout_s: float = 60.0) -> None:
    """Kill this process (SIGKILL) once every chunk queued for `peer` has been handed to ZeroMQ,
    and a second more for its I/O thread to put them on the socket."""
    deadline = time.monotonic() + timeout_s
    while outbox.queued(peer) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
