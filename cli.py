"""`multipod`: the one command, dispatched to the worker side or the controller side.

Installed as `multipod.cli`. This is the only module that knows both sides (the package ladder in
docs/architecture.md); it imports neither jax nor anything that does, because `multipod worker`
must set the simulated device count before jax initialises.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The `multipod` parser: `worker` from the worker side, every other command from the controller."""
    from multipod.controller.commands import add_commands
    from multipod.pod_worker.main import add_arguments as add_worker_arguments

    parser = argparse.ArgumentParser(prog="multipod", description="Multi-pod language-model training on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_arguments(sub.add_parser("worker", help="serve one pod"))
    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        from multipod.pod_worker.main import run
        return run(args)
    from multipod.controller.commands import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
