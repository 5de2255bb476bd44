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
    add_security_arguments(parser)
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve without a shared secret (only for a trusted single-machine setup)")


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """--auth-token and the TLS files: the same flags on the worker and the controller."""
    parser.add_argument("--auth-token", help="shared secret every RPC must carry (default: $MULTIPOD_AUTH_TOKEN); "
                        "prefer the environment variable: command lines are visible to other users")
    parser.add_argument("--tls-cert", help="PEM certificate chain of this process (enables TLS)")
    parser.add_argument("--tls-key", help="PEM private key for --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA to check peers against; a server given one requires client "
                        "certificates signed by it (mutual TLS)")
    parser.add_argument("--tls-server-name", help="name expected in servers' certificates (default: their host)")


def security_from_args(args: argparse.Namespace):
    """The Security of this process from the flags (and $MULTIPOD_AUTH_TOKEN)."""
    from protos.transport import Security
    return Security.from_args(args.auth_token, args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


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
    from protos.transport import SecurityError, set_default_security
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
    from pod_worker.server import serve
    serve(args.pod_index, args.listen, port_file=args.port_file, exit_with_parent=args.exit_with_parent,
          security=security)
    return 0
