"""A deadline on a controller process's exit, after its command has returned.

What the command owns (workers, namespaces, Ray actors) is gone by then, but the interpreter's
teardown still runs the libraries' atexit handlers and finalizers, and one of them can block:
Ray's driver teardown and gRPC channels' `__del__` are known to wait for ever now and then. A
process that has finished its work must not hang, so a daemon thread ends it with the command's
exit code once `seconds` have passed, after printing every thread's stack: the hang is then a
line in the output to trace, not a test or a job that never ends.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading

EXIT_DEADLINE_S = 20.0


def arm(code: int, seconds: float | None = None) -> threading.Thread:
    """Start the watch: if the process is still alive `seconds` (default EXIT_DEADLINE_S) from
    now, say so, dump every thread's stack to stderr and leave with exit code `code`."""
    seconds = EXIT_DEADLINE_S if seconds is None else seconds
    def watch() -> None:
        threading.Event().wait(seconds)
        try:
            print(f"warning: the process's exit did not finish within {seconds:g}s of the command's end "
                  f"(a library's teardown is blocked); leaving with exit code {code}. Its threads:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    thread = threading.Thread(target=watch, name="exit-deadline", daemon=True)
    thread.start()
    return thread
