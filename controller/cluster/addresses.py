"""The pods' worker addresses as the command line gives them: `--workers` read into one list of
HOST:PORT per pod (";" between pods, "," between a pod's hosts, or @FILE with one pod per line),
one pod's host list checked (generate --workers, attach --worker), and a connect() entry read as
one pod's hosts. A bad address is a ConfigError naming the flag and where the address is listed.
"""
from __future__ import annotations

import pathlib

from multipod.model.config import ConfigError
from multipod.protos.cli_flags import host_port_problem


def check_pod_hosts(flag: str, hosts: list[str]) -> list[str]:
    """`hosts`, one pod's HOST:PORT in host order (generate --workers, attach --worker), if each is
    an address; else ConfigError naming `flag` and the host."""
    for host, address in enumerate(hosts):
        problem = host_port_problem(address)
        if problem:
            raise ConfigError(flag, f"host {host}: {problem}")
    return hosts


def parse_workers(spec: str) -> list[list[str]]:
    """The pods' host addresses from `--workers`: `p0h0:port,p0h1:port;p1h0:port,p1h1:port`
    (";" between pods, "," between the hosts of a pod); without ";", "," separates pods of one
    host each; `@FILE` reads one pod per line (hosts separated by commas or spaces, "#" starts a
    comment). ConfigError("--workers", ...) naming the pod if the pods list different numbers of
    hosts, a pod lists none, or an address appears twice."""
    spec = spec.strip()
    if spec.startswith("@"):
        path = pathlib.Path(spec[1:]).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError("--workers", f"cannot read the hosts file {path}: {exc.strerror or exc}") from None
        pods = [line.split("#", 1)[0].replace(",", " ").split() for line in text.splitlines()]
        pods = [hosts for hosts in pods if hosts]
        where = f" in {path}"
    elif ";" in spec:
        segments = spec.split(";")
        if segments and not segments[-1].strip():
            segments.pop()      # a trailing ";"
        pods = [[a.strip() for a in segment.split(",") if a.strip()] for segment in segments]
        empty = [p for p, hosts in enumerate(pods) if not hosts]
        if empty:
            raise ConfigError("--workers", f"pod {empty[0]} lists no hosts (\";\" separates pods, \",\" the "
                              f"hosts of one pod): {spec!r}")
        where = ""
    else:
        pods = [[a.strip()] for a in spec.split(",") if a.strip()]
        where = ""
    if not pods:
        raise ConfigError("--workers", f"no worker addresses given{where}")
    counts = [len(hosts) for hosts in pods]
    for p, hosts in enumerate(pods):
        if len(hosts) != counts[0]:
            raise ConfigError("--workers", f"pod {p} lists {len(hosts)} host(s) ({', '.join(hosts)}) but pod 0 "
                              f"lists {counts[0]} ({', '.join(pods[0])}){where}: every pod must have the same "
                              f"number of hosts")
    seen: dict[str, tuple[int, int]] = {}
    for p, hosts in enumerate(pods):
        for h, address in enumerate(hosts):
            problem = host_port_problem(address)
            if problem:
                raise ConfigError("--workers", f"pod {p} host {h}{where}: {problem}")
            if address in seen:
                first = seen[address]
                raise ConfigError("--workers", f"{address} is listed twice{where}: as pod {first[0]} host {first[1]} "
                                  f"and as pod {p} host {h}")
            seen[address] = (p, h)
    return pods


def pod_hosts(entry) -> list[str]:
    """One pod's host addresses from a connect() entry: a list of them, or one string with the
    hosts separated by "," (a single-host pod's address is just that address)."""
    hosts = [a.strip() for a in entry.split(",")] if isinstance(entry, str) else [str(a).strip() for a in entry]
    return [a for a in hosts if a]
