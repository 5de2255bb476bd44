"""The security flags that the worker and the controller share (argparse only: `multipod --help`
must work without importing grpc or jax)."""
from __future__ import annotations

import argparse


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
    """The transport.Security of this process from the flags (and $MULTIPOD_AUTH_TOKEN)."""
    from multipod.protos.channels import Security
    return Security.from_args(args.auth_token, args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def host_port_problem(address: str, listen: bool = False) -> str | None:
    """Why `address` is not HOST:PORT, or None if it is. An IPv6 host goes in brackets
    ([::1]:50051); the port is at most 65535 (gRPC listens on a larger one modulo 65536, somewhere
    else), and 0 (any free port) only where it is listened on (`listen`), not connected to."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host:
        return f"{address!r} is not HOST:PORT"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"{address!r}: an IPv6 host goes in brackets, as [::1]:50051"
    low = 0 if listen else 1
    if not port.isdigit() or not low <= int(port) <= 65535:
        return f"{address!r}: the port must be a number from {low} to 65535"
    return None
