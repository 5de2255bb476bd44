"""controller/core/interrupt.py: a Ctrl-C that lands in a finaliser, where Python swallows the
KeyboardInterrupt, is raised again at the step loop's next check."""
import gc
import signal
import sys

import pytest

from multipod.controller.core import interrupt


class _Finalised:
    """An object whose finaliser is running when SIGINT arrives (as a gRPC call's __del__ may be)."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)
        for _ in range(1000):     # the handler runs at a bytecode boundary in here
            pass


def test_an_interrupt_swallowed_by_a_finaliser_is_raised_at_the_next_check(monkeypatch):
    swallowed = []      # what Python would print as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    # Python's own handler first, whatever this process inherited: a suite started as a background
    # job (`pytest &` in a script) inherits SIGINT ignored, and install() rightly keeps it so.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt.install()
        interrupt.raise_if_requested()          # nothing pressed yet: nothing raised
        obj = _Finalised()
        del obj
        gc.collect()
        assert swallowed == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            interrupt.raise_if_requested()
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupt._requested.clear()


def test_a_process_that_ignores_sigint_keeps_ignoring_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
