"""What each host's worker is started with under `multipod ray`, beyond its ports: its flags (the
security the controller was given, the same paths on every node), its environment (the run's
MULTIPOD_ and JAX_ variables, never the auth token, and a compilation cache in the run directory),
and the check that workers listening beyond loopback are encrypted."""
from __future__ import annotations

import os
import pathlib

from multipod.controller.launch.local import LaunchError
from multipod.protos.channels import TOKEN_ENV, Security


def worker_flags(security: Security, dcn_encrypt: bool, insecure: bool) -> tuple[str, ...]:
    """The `multipod worker` flags of every host of the run."""
    flags = []
    if dcn_encrypt:
        flags.append("--dcn-encrypt")
    if insecure:
        flags.append("--insecure")
    if not security.token:
        flags.append("--insecure-no-auth")
    sec = security
    for flag, value in (("--tls-cert", sec.tls_cert), ("--tls-key", sec.tls_key), ("--tls-ca", sec.tls_ca),
                        ("--tls-server-name", sec.tls_server_name)):
        if value:   # the same paths on every node
            flags += [flag, str(pathlib.Path(value).absolute())]
    return tuple(flags)


def worker_env(run_dir: pathlib.Path) -> tuple[tuple[str, str], ...]:
    """The environment variables every host's worker gets, sorted: this process's MULTIPOD_ and
    JAX_ ones but the token, and a compilation cache in the run directory unless one is set."""
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if (k.startswith("MULTIPOD_") or k.startswith("JAX_")) and k != TOKEN_ENV))
    if not any(k == "JAX_COMPILATION_CACHE_DIR" for k, _ in env):
        # As under `multipod local`: a restarted worker loads its compiled step instead of compiling it.
        env += (("JAX_COMPILATION_CACHE_DIR", str((run_dir / ".jax-cache").absolute())),
                ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
    return env


def check_exposure(security: Security, dcn_encrypt: bool, insecure: bool, on_this_machine: bool) -> None:
    """Workers on other nodes listen beyond loopback: refused unencrypted unless --insecure
    (the worker would refuse too; this says it before any worker starts)."""
    if on_this_machine or insecure:
        return
    missing = []
    if not security.tls_cert:
        missing.append("TLS for the control plane (--tls-cert/--tls-key, --tls-ca)")
    if not dcn_encrypt:
        missing.append("an encrypted data plane (--set dcn.encrypt=true)")
    if missing:
        raise LaunchError("the pods run on other nodes than the controller, so their workers listen beyond "
                          "loopback: that needs " + " and ".join(missing)
                          + ", or --insecure on a network you trust")
