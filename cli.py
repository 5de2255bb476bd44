"""`multipod`: the one command, dispatched to the worker side or the controller side.

Installed as `multipod.cli`. This is the only module that knows both sides (the package ladder in
docs/architecture.md); it imports neither jax nor anything that does, because `multipod worker`
must set the simulated device count before jax initialises.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys

# Python's cyclic collector runs a young-generation pass every 700 net allocations of container
# objects (3.11's default). Importing jax and flax and tracing a model's programs allocate
# millions of short-lived ones, so a worker's start spent thousands of passes that found little
# (measured in docs/benchmarks.md, "Thirty-seventh session"). Cyclic garbage is still collected,
# only in fewer, larger passes.
GC_THRESHOLDS = (50_000, 50, 100)


def build_parser(worker_only: bool = False) -> argparse.ArgumentParser:
    """The `multipod` parser: `worker` from the worker side, every other command from the
    controller. worker_only: just `worker` (a worker process, started hundreds of times in a
    test session and once per host in a cluster, need not import the controller's commands)."""
    from multipod.pod_worker.main import add_arguments as add_worker_arguments

    parser = argparse.ArgumentParser(prog="multipod", description="Multi-pod language-model training on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_arguments(sub.add_parser("worker", help="serve one pod"))
    if not worker_only:
        from multipod.controller.commands import add_commands
        add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(worker_only=argv[:1] == ["worker"]).parse_args(argv)
    if args.command == "worker":
        from multipod.pod_worker.main import run
        return run(args)
    from multipod.controller.commands import run
    return run(args)


def entry() -> None:
    """The process's entry (the `multipod` script, `python -m multipod.cli`): run the command,
    then give the interpreter's teardown a deadline (controller/core/exit_deadline.py). Only
    here, never in `main`: a caller that runs `main` in its own process (a test, a notebook)
    must not have that process ended under it 20 s later. A controller command's Ctrl-C is
    never lost (controller/core/interrupt.py)."""
    # A crash in native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: XLA, gRPC, ZeroMQ) prints
    # every thread's Python stack to stderr (a worker's log) before the process dies, instead of
    # ending it without a word.
    faulthandler.enable()
    gc.set_threshold(*GC_THRESHOLDS)
    # numpy's OpenBLAS starts a thread per core at import, and each spins for a while waiting for
    # work. No multipod process multiplies matrices with numpy (XLA does the model's algebra), so
    # the spinning only took a core from the process's real work (docs/benchmarks.md,
    # "Thirty-eighth session"). Set before anything imports numpy; a user's own setting stands.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    controller = sys.argv[1:2] != ["worker"]
    if controller:
        from multipod.controller.core.interrupt import install
        install()
    code = main()
    if controller:
        from multipod.controller.core.exit_deadline import arm
        arm(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
