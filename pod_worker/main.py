"""`multipod worker`: serve one pod.

The simulated device count must be in XLA_FLAGS before jax initialises, so this module sets it
before importing anything that imports jax.
"""
from __future__ import annotations

import argparse
import logging

from multipod.pod_worker.devices import simulate_cpu_devices
from multipod.protos.cli_flags import add_security_arguments, security_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pod-index", type=int, required=True, help="this pod's index (0-based)")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve on")
    parser.add_argument("--devices", type=int, default=0,
                        help="simulate N CPU devices (0: use the real devices jax finds)")
    parser.add_argument("--port-file", help="write the bound port here once serving (for launchers)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="shut down when the process that started this worker exits")
    add_security_arguments(parser)
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve without a shared secret (only for a trusted single-machine setup)")


def run(args: argparse.Namespace) -> int:
    if args.pod_index < 0:
        raise SystemExit("--pod-index must be >= 0")
    if args.devices < 0:
        raise SystemExit("--devices must be >= 0")
    if args.devices:
        simulate_cpu_devices(args.devices)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s pod{args.pod_index} %(levelname)s %(name)s: %(message)s")
    from multipod.protos.transport import SecurityError, set_default_security
    try:
        security = security_from_args(args)
    except SecurityError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not security.token and not args.insecure_no_auth:
        raise SystemExit("error: no auth token: pass --auth-token or set MULTIPOD_AUTH_TOKEN (the same secret "
                         "the controller uses), or --insecure-no-auth for a trusted single-machine setup")
    if not security.token:
        logging.getLogger(__name__).warning("serving WITHOUT authentication (--insecure-no-auth)")
    set_default_security(security)   # the worker's DCN links carry the same credentials
    from multipod.pod_worker.lifecycle import serve
    serve(args.pod_index, args.listen, port_file=args.port_file, exit_with_parent=args.exit_with_parent,
          security=security)
    return 0
