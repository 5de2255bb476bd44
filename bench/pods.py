"""Pod workers a benchmark starts itself, one pod per CPU core (bench/scaling.py, bench/vs_maxtext.py):
on loopback (controller/launch/local.py's LocalPods) or, with netns, each host in a network
namespace of its own behind a kernel link shaped to a rate (controller/launch/netns_pods.py's
NetnsPods). Only the pinning is added here: every host of pod p runs under `taskset -c cores[p]`.

The workers' secret comes from this process's MULTIPOD_AUTH_TOKEN (the controller that a bench
starts reads the same variable). Under netns the workers listen beyond loopback: unencrypted with
--insecure unless `encrypt` (TLS + CURVE with the run's own certificates; the controller then needs
controller_flags(pods) and `dcn.encrypt = true`).
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys

from multipod.controller.launch.local import LocalPods
from multipod.controller.launch.netns_pods import NetnsPods
from multipod.protos.channels import TOKEN_ENV, Security


def pin(core: int, argv: list[str]) -> list[str]:
    """`argv` (a `python -m ...` command) run on CPU `core` only: taskset, or where there is none
    a fresh interpreter that sets its own affinity before running the module (never a fork of a
    process that imported jax)."""
    if shutil.which("taskset"):
        return ["taskset", "-c", str(core), *argv]
    module, rest = argv[2], argv[3:]
    code = (f"import os, runpy, sys; os.sched_setaffinity(0, {{{core}}}); sys.argv = {[module, *rest]!r}; "
            f"runpy.run_module({module!r}, run_name='__main__')")
    return [argv[0], "-c", code]


class _Pinned:
    """Mixin for a LocalPods subclass: every host of pod p runs on cores[p]."""
    cores: list[int]

    def command(self, pod: int, host: int, listen: str, port_file: pathlib.Path, dcn_listen: str) -> list[str]:
        cmd = super().command(pod, host, listen, port_file, dcn_listen)  # type: ignore[misc]
        start = cmd.index(sys.executable)     # after `ip netns exec NS` under NetnsPods
        return [*cmd[:start], *pin(self.cores[pod], cmd[start:])]


class PinnedPods(_Pinned, LocalPods):
    def __init__(self, cores: list[int], devices_per_pod: int, log_dir: pathlib.Path, **kwargs):
        self.cores = list(cores)
        super().__init__(len(cores), devices_per_pod, log_dir, **kwargs)


class PinnedNetnsPods(_Pinned, NetnsPods):
    def __init__(self, cores: list[int], devices_per_pod: int, log_dir: pathlib.Path, **kwargs):
        self.cores = list(cores)
        super().__init__(len(cores), devices_per_pod, log_dir, **kwargs)


def pinned_pods(cores: list[int], log_dir: pathlib.Path, *, hosts_per_pod: int = 1, devices_per_host: int = 1,
                netns: bool = False, rate_gbps: float = 0.0, encrypt: bool = False,
                start_timeout_s: float = 180.0) -> LocalPods:
    """Pods (not started: use as a context manager) of `hosts_per_pod` workers with
    `devices_per_host` simulated devices each, pod p pinned to cores[p]. netns: each host in its
    own namespace, each pod's link shaped to rate_gbps (0: unshaped)."""
    token = os.environ.get(TOKEN_ENV, "")
    common = dict(hosts_per_pod=hosts_per_pod, security=Security(token=token),
                  start_timeout_s=start_timeout_s)   # one core each, maybe under load: slow imports
    devices = hosts_per_pod * devices_per_host
    if not netns:
        if rate_gbps:
            raise ValueError("a link rate needs netns (on loopback, use dcn.link_gbps)")
        return PinnedPods(cores, devices, log_dir, **common)
    return PinnedNetnsPods(cores, devices, log_dir, rate_gbps=rate_gbps, encrypt=encrypt, insecure=not encrypt,
                           **common)


def controller_flags(pods: LocalPods) -> list[str]:
    """The flags `multipod train --workers` needs for these pods: the run's client certificate
    when they serve TLS (NetnsPods with encrypt), else none."""
    if not isinstance(pods, NetnsPods) or pods.certificates is None:
        return []
    security = pods.controller_security
    return ["--tls-cert", security.tls_cert, "--tls-key", security.tls_key, "--tls-ca", security.tls_ca,
            "--set", "dcn.encrypt=true"]


def describe(pods: LocalPods) -> str:
    """Where the pods run, for a bench's JSON."""
    return pods.describe() if isinstance(pods, NetnsPods) else "loopback (127.0.0.1)"
