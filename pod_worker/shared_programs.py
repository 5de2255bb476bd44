"""Jitted programs shared by every trainer of a process that needs the same ones.

A `jax.jit` wrapper made per trainer around a fresh closure is a new function to jax: its caches
(trace, lowering, executable) miss, so the same program is traced, lowered and loaded from the
persistent compilation cache again for every trainer built in the process: each pod of an
in-process test, each restore or rejoin that builds a trainer anew. Counted over the pod_worker
unit tests, 851 of 1,241 program loads were such repeats (same program, same devices).

`shared` memoises a factory of jitted programs on its arguments, so that equal arguments give
back the very same jit objects and jax's in-memory caches hit. The arguments must determine
the programs entirely: configs (frozen dataclasses), meshes and shardings, or pytrees of them
(flattened for the key), never arrays or state.
"""
from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import jax

T = TypeVar("T")

MAX_ENTRIES = 64    # per factory: a long-lived worker that meets many layouts keeps a bounded set
_FACTORIES: list[tuple[collections.OrderedDict, threading.Lock]] = []   # every factory's programs (clear)


def _key(args: tuple) -> tuple:
    """A hashable key for arguments that may be pytrees of hashable leaves (shardings, configs)."""
    return tuple((jax.tree.structure(arg), tuple(jax.tree.leaves(arg))) for arg in args)


def shared(factory: Callable[..., T]) -> Callable[..., T]:
    """`factory(*args)` once per distinct arguments (positional only; see the module docstring),
    then the same result for equal arguments; at most MAX_ENTRIES kept, least recently used
    dropped first. Safe to call from several threads."""
    made: collections.OrderedDict[tuple, T] = collections.OrderedDict()
    lock = threading.Lock()

    @functools.wraps(factory)
    def get(*args):
        key = _key(args)
        with lock:
            if key in made:
                made.move_to_end(key)
                return made[key]
            result = made[key] = factory(*args)
            if len(made) > MAX_ENTRIES:
                made.popitem(last=False)
            return result

    _FACTORIES.append((made, lock))
    return get


def clear() -> None:
    """Forget every shared program: trainers built after this make their own, as in a new process
    (jax's caches of other programs stay)."""
    for made, lock in _FACTORIES:
        with lock:
            made.clear()
