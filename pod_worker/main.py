"""`multipod worker`: serve one pod.

The simulated device count must be in XLA_FLAGS before jax initialises, so this module sets it
before importing anything that imports jax.
"""
from __future__ import annotations

import argparse
import logging
import os
import re


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pod-index", type=int, required=True, help="this pod's index (0-based)")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve on")
    parser.add_argument("--devices", type=int, default=0,
                        help="simulate N CPU devices (0: use the real devices jax finds)")
    parser.add_argument("--port-file", help="write the bound port here once serving (for launchers)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="shut down when the process that started this worker exits")


def set_device_count(n: int) -> None:
    """Make jax (not yet imported) see n CPU devices."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(args: argparse.Namespace) -> int:
    if args.pod_index < 0:
        raise SystemExit("--pod-index must be >= 0")
    if args.devices < 0:
        raise SystemExit("--devices must be >= 0")
    if args.devices:
        set_device_count(args.devices)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s pod{args.pod_index} %(levelname)s %(name)s: %(message)s")
    from pod_worker.server import serve
    serve(args.pod_index, args.listen, port_file=args.port_file, exit_with_parent=args.exit_with_parent)
    return 0
