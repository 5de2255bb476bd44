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
