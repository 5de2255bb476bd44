"""Ctrl-C that is never lost.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. If that
is inside a finaliser (a gRPC call object's __del__, run by the garbage collector in the middle of
the step loop), Python prints "Exception ignored in ..." and the interrupt is gone: the run trains
on as if nothing was pressed (seen once in tests/e2e/test_local_interrupt.py, whose run went on
for the test's whole 120 s). The handler installed here raises KeyboardInterrupt as Python's does
and also remembers it; the step loop raises it again at its next check if it was swallowed.
"""
from __future__ import annotations

import signal
import threading

_requested = threading.Event()


def install() -> None:
    """From the main thread, before a controller command runs: Ctrl-C raises KeyboardInterrupt and
    is remembered. A process started with SIGINT ignored (a background job) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return

    def on_interrupt(signum, frame):
        _requested.set()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_interrupt)


def raise_if_requested() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed since install() (again, if a finaliser
    swallowed the first one)."""
    if _requested.is_set():
        raise KeyboardInterrupt
