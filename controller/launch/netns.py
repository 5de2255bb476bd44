"""A private network for `multipod local --netns`: every host of every pod in a Linux network
namespace of its own, with its own address, as on a real cluster.

Topology (all links are veth pairs; the bridges live in one namespace of the run's own, `-net`):

    controller (root namespace, the subnet's first address on link mpPID-N)
        │
     bridge "dcn" ─── p0dcn ═══ p0up ─── bridge "pod0" ─── p0h0 ── eth0 (namespace -p0h0)
        │                                        └──────── p0h1 ── eth0 (namespace -p0h1)
        └──────────── p1dcn ═══ p1up ─── bridge "pod1" ─── ...

A pod's hosts share one bridge: traffic between them (jax.distributed, the gather of a pod's
blocks) stays inside the pod, as on a pod's own interconnect. The p<P>dcn ═ p<P>up pair is the
pod's DCN link: everything that leaves or enters the pod (gradients to the other pods, the
controller's RPCs) crosses it, and `rate_gbps` shapes it with a tbf qdisc on both of its ends,
i.e. R each way. This kernel has no netem: a shaped link has a rate, not a delay
(dcn.link_latency_ms adds one in the workers).

Names carry the controller's pid (namespaces `multipod-PID-N-*`, the root link `mpPID-N`), so what
a killed run left behind is recognised and removed by the next `--netns` run (clean_stale).
Needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN (`ip netns add` mounts), and iproute2's `ip` (and
`tc` to shape).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import itertools
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from multipod.controller.launch.local import LaunchError

# Where an address range is picked when none is given: the first /24 of it that this machine uses
# nowhere (no interface address, no route overlaps it).
AUTO_POOL = ipaddress.IPv4Network("10.213.0.0/16")
AUTO_PREFIX = 24
NAME_PREFIX = "multipod"      # namespaces: multipod-PID-N-net, multipod-PID-N-p<pod>h<host>
LINK_PREFIX = "mp"            # the controller's link in the root namespace: mpPID-N
_NAMESPACE = re.compile(rf"^{NAME_PREFIX}-(\d+)-(\d+)-")
_LINK = re.compile(rf"^{LINK_PREFIX}(\d+)-(\d+)$")
IFNAMSIZ = 15                 # the kernel's limit on an interface name
CAP_SYS_ADMIN, CAP_NET_ADMIN = 21, 12
_COMMAND_TIMEOUT_S = 30.0
_runs = itertools.count()     # runs of this process: several NetnsPods may live in one process


class NetnsError(LaunchError):
    """The namespaces cannot be made: missing permission or tools, a bad or used address range,
    or a command of `ip`/`tc` that failed."""


# -- pure logic ----------------------------------------------------------------------------------
def missing_permissions(capabilities: int, tools: dict[str, str | None]) -> list[str]:
    """What is missing to make namespaces: `capabilities` is the effective capability mask
    (/proc/self/status CapEff), `tools` maps a needed command to its path (None: not found)."""
    missing = [f"the `{tool}` command (iproute2) on PATH" for tool, path in tools.items() if path is None]
    for bit, name, why in ((CAP_NET_ADMIN, "CAP_NET_ADMIN", "to create links and addresses"),
                           (CAP_SYS_ADMIN, "CAP_SYS_ADMIN", "for `ip netns add`, which mounts the namespace")):
        if not capabilities >> bit & 1:
            missing.append(f"{name} ({why}; run as root)")
    return missing


def parse_used_networks(addr_text: str, route_text: str) -> list[tuple[ipaddress.IPv4Network, str]]:
    """The IPv4 networks this machine uses, each with where it was seen, from the output of
    `ip -o -4 addr show` and `ip -4 route show table all`."""
    used = []
    for line in addr_text.splitlines():
        fields = line.split()
        if "inet" in fields:
            cidr = fields[fields.index("inet") + 1]
            used.append((ipaddress.IPv4Interface(cidr).network, f"address {cidr} on {fields[1]}"))
    for line in route_text.splitlines():
        fields = line.split()
        if fields and fields[0] in ("local", "broadcast", "unicast", "blackhole", "unreachable", "prohibit"):
            fields = fields[1:]     # a typed route: the destination follows the type
        if not fields or fields[0] == "default":
            continue
        try:
            network = ipaddress.IPv4Network(fields[0], strict=False)
        except ValueError:
            continue
        if network.prefixlen == 32 and network.network_address.is_loopback:
            continue
        dev = fields[fields.index("dev") + 1] if "dev" in fields else "?"
        used.append((network, f"route {fields[0]} via {dev}"))
    return used


def choose_subnet(requested: str | None, addresses: int,
                  used: list[tuple[ipaddress.IPv4Network, str]]) -> ipaddress.IPv4Network:
    """The run's subnet: `requested` (CIDR) if it is private, holds `addresses` hosts and overlaps
    nothing in `used`; without one, the first free /24 of AUTO_POOL. NetnsError says why not."""
    if requested:
        try:
            subnet = ipaddress.IPv4Network(requested, strict=True)
        except ValueError as exc:
            raise NetnsError(f"--netns-subnet {requested!r}: not an IPv4 network in CIDR form "
                             f"(e.g. 10.213.0.0/24): {exc}") from None
        if not subnet.is_private or subnet.is_loopback or subnet.is_link_local or subnet.is_multicast:
            raise NetnsError(f"--netns-subnet {subnet}: not a private range (use one of 10.0.0.0/8, "
                             f"172.16.0.0/12, 192.168.0.0/16)")
        if subnet.num_addresses - 2 < addresses:
            raise NetnsError(f"--netns-subnet {subnet}: {subnet.num_addresses - 2} usable address(es), the run "
                             f"needs {addresses} (the controller and one per host)")
        for network, where in used:
            if subnet.overlaps(network):
                raise NetnsError(f"--netns-subnet {subnet} is already used on this machine ({where}); "
                                 f"pick another range")
        return subnet
    if 2 ** (32 - AUTO_PREFIX) - 2 < addresses:
        raise NetnsError(f"{addresses} addresses do not fit a /{AUTO_PREFIX}: give a larger --netns-subnet")
    for subnet in AUTO_POOL.subnets(new_prefix=AUTO_PREFIX):
        if not any(subnet.overlaps(network) for network, _ in used):
            return subnet
    raise NetnsError(f"every /{AUTO_PREFIX} of {AUTO_POOL} is in use on this machine: give --netns-subnet")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The names and addresses of one run's network (no side effects)."""
    run_id: str                 # "PID-N": the controller's pid, and its count of runs
    subnet: ipaddress.IPv4Network
    num_pods: int
    hosts_per_pod: int

    def __post_init__(self):
        if len(self.root_link) > IFNAMSIZ:
            raise NetnsError(f"link name {self.root_link!r} is longer than {IFNAMSIZ} characters")
        if self.subnet.num_addresses - 2 < 1 + self.num_pods * self.hosts_per_pod:
            raise NetnsError(f"{self.subnet} is too small for the controller and {self.num_pods} x "
                             f"{self.hosts_per_pod} hosts")

    @property
    def prefix(self) -> str:
        """What every namespace of this run starts with."""
        return f"{NAME_PREFIX}-{self.run_id}-"

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}net"

    def namespace(self, pod: int, host: int) -> str:
        return f"{self.prefix}p{pod}h{host}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the run, the bridges' first."""
        return [self.bridge_namespace] + [self.namespace(p, h) for p in range(self.num_pods)
                                          for h in range(self.hosts_per_pod)]

    @property
    def root_link(self) -> str:
        """The controller's end of its link, in the root namespace."""
        return f"{LINK_PREFIX}{self.run_id}"

    @property
    def controller_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def host_ip(self, pod: int, host: int) -> str:
        return str(self.subnet.network_address + 2 + pod * self.hosts_per_pod + host)


def tbf_args(rate_gbps: float) -> list[str]:
    """tc's arguments of a token bucket at `rate_gbps`: a burst of 5 ms of the rate (at least
    256 KiB, so a 64 KiB segmentation-offload packet always fits), and 50 ms of queue, so TCP
    keeps the link busy instead of losing packets to a short queue."""
    if not 0 < rate_gbps < math.inf:
        raise NetnsError(f"--netns-rate-gbps must be > 0, got {rate_gbps}")
    bytes_per_s = rate_gbps * 1e9 / 8
    burst = max(256 * 1024, int(bytes_per_s * 0.005))
    return ["tbf", "rate", f"{int(rate_gbps * 1e6)}kbit", "burst", str(burst), "latency", "50ms"]


# -- the machine ---------------------------------------------------------------------------------
def check_available(shape: bool) -> dict[str, str]:
    """The paths of `ip` (and `tc` when shaping); NetnsError naming everything that is missing to
    make namespaces here."""
    tools = {"ip": shutil.which("ip")} | ({"tc": shutil.which("tc")} if shape else {})
    missing = missing_permissions(_effective_capabilities(), tools)
    if missing:
        raise NetnsError("--netns cannot make network namespaces here: missing " + "; ".join(missing))
    return {tool: path for tool, path in tools.items() if path}


def _effective_capabilities() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
                            stdin=subprocess.DEVNULL)
    if check and result.returncode:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {result.returncode}): "
                         f"{(result.stderr or result.stdout).strip()}")
    return result


@contextlib.contextmanager
def _machine_lock():
    """One run at a time picks its range and makes its root link, so two runs that start together
    do not both take the same free range."""
    path = pathlib.Path(tempfile.gettempdir()) / "multipod-netns.lock"
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*: a namespace's own /etc/hosts.
ETC_NETNS = pathlib.Path("/etc/netns")


def _etc_dir(namespace: str) -> pathlib.Path:
    return ETC_NETNS / namespace


def _namespaces(ip: str) -> list[str]:
    """The names `ip netns list` shows (each line: NAME, maybe followed by "(id: N)")."""
    listed = _run([ip, "netns", "list"], check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _remove_namespace(ip: str, namespace: str) -> None:
    """Kill what still runs in `namespace`, then delete it and its /etc/netns files."""
    pids = _run([ip, "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run([ip, "netns", "delete", namespace], check=False)
    shutil.rmtree(_etc_dir(namespace), ignore_errors=True)


def clean_stale(ip: str = "ip") -> list[str]:
    """Remove the namespaces and root links that runs whose controller is gone left behind (a
    killed `multipod local --netns`); returns their names. Runs of live processes are left alone."""
    removed = []
    # The root links first: each is a veth whose peer lives in its run's `-net` namespace, and the
    # kernel tears a removed namespace's devices down in the background, that peer's root end with
    # them, so after the namespaces a link might be there or not.
    for line in _run([ip, "-o", "link", "show"], check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        match = _LINK.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _run([ip, "link", "delete", name], check=False)
            removed.append(name)
    for name in _namespaces(ip):
        match = _NAMESPACE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(ip, name)
            removed.append(name)
    for etc in ETC_NETNS.glob(f"{NAME_PREFIX}-*"):      # a namespace's files, the namespace gone
        match = _NAMESPACE.match(etc.name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(etc, ignore_errors=True)
    return removed


class Network:
    """One run's namespaces, bridges and links: create() makes them, destroy() removes all of
    them (also after a create() that failed halfway), wrap() runs a command in a host's namespace.
    subnet: CIDR, or None to pick a free /24 of AUTO_POOL; rate_gbps: shape each pod's link (0:
    unshaped)."""

    def __init__(self, num_pods: int, hosts_per_pod: int, subnet: str | None = None, rate_gbps: float = 0.0):
        if rate_gbps:
            tbf_args(rate_gbps)     # refuses a rate that is not a positive number
        self.num_pods, self.hosts_per_pod = num_pods, hosts_per_pod
        self.requested_subnet, self.rate_gbps = subnet, rate_gbps
        self.run_id = f"{os.getpid()}-{next(_runs)}"
        self.layout: Layout | None = None
        self.tools: dict[str, str] = {}
        self.cleaned: list[str] = []     # what clean_stale removed before this run

    def create(self) -> Layout:
        """Check the machine, remove stale runs' leftovers, pick the range, make everything."""
        self.tools = check_available(shape=bool(self.rate_gbps))
        ip = self.tools["ip"]
        with _machine_lock():
            self.cleaned = clean_stale(ip)
            used = parse_used_networks(_run([ip, "-o", "-4", "addr", "show"]).stdout,
                                       _run([ip, "-4", "route", "show", "table", "all"]).stdout)
            subnet = choose_subnet(self.requested_subnet, 1 + self.num_pods * self.hosts_per_pod, used)
            self.layout = layout = Layout(self.run_id, subnet, self.num_pods, self.hosts_per_pod)
            for namespace in layout.namespaces:
                _run([ip, "netns", "add", namespace])
            # The controller's link first: once its address is up, the range shows as used.
            net = layout.bridge_namespace
            self._link(layout.root_link, "ctl", net, root=True)
            _run([ip, "addr", "add", f"{layout.controller_ip}/{subnet.prefixlen}", "dev", layout.root_link])
            _run([ip, "link", "set", layout.root_link, "up"])
        self._in(net, "link", "set", "lo", "up")
        self._bridge(net, "dcn")
        self._attach(net, "ctl", "dcn")
        hostname = os.uname().nodename
        for pod in range(self.num_pods):
            bridge = f"pod{pod}"
            self._bridge(net, bridge)
            self._link(f"p{pod}up", f"p{pod}dcn", net)
            self._attach(net, f"p{pod}up", bridge)
            self._attach(net, f"p{pod}dcn", "dcn")
            if self.rate_gbps:     # both ends' egress: out of the pod, and into it
                for end in (f"p{pod}up", f"p{pod}dcn"):
                    _run([self.tools["tc"], "-n", net, "qdisc", "add", "dev", end, "root", *tbf_args(self.rate_gbps)])
            for host in range(self.hosts_per_pod):
                namespace = layout.namespace(pod, host)
                self._link(f"p{pod}h{host}", "eth0", net, peer_namespace=namespace)
                self._attach(net, f"p{pod}h{host}", bridge)
                address = layout.host_ip(pod, host)
                self._in(namespace, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
                self._in(namespace, "link", "set", "eth0", "up")
                self._in(namespace, "link", "set", "lo", "up")
                # This host's name resolves to its own address inside its namespace, as on a real
                # host: gloo (the collectives between a pod's hosts) binds to what it resolves to.
                etc = _etc_dir(namespace)
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{address} {hostname}\n")
        return layout

    def wrap(self, pod: int, host: int, argv: list[str]) -> list[str]:
        """`argv` run in the namespace of `host` of `pod` (`ip netns exec` execs: same pid)."""
        assert self.layout is not None, "create() first"
        return [self.tools["ip"], "netns", "exec", self.layout.namespace(pod, host), *argv]

    def destroy(self) -> None:
        """Remove everything of this run that exists (each step on its own: one that fails does
        not keep the others from running). Call after the processes have stopped; any left are
        killed."""
        ip = self.tools.get("ip") or shutil.which("ip")
        if ip is None:
            return
        link = f"{LINK_PREFIX}{self.run_id}"
        if _run([ip, "link", "show", link], check=False).returncode == 0:
            _run([ip, "link", "delete", link], check=False)
        prefix = f"{NAME_PREFIX}-{self.run_id}-"
        for name in _namespaces(ip):
            if name.startswith(prefix):
                _remove_namespace(ip, name)
        for etc in ETC_NETNS.glob(f"{prefix}*"):
            shutil.rmtree(etc, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """This run's namespaces and root link that still exist (for checks after destroy())."""
        ip = self.tools.get("ip") or "ip"
        return leftovers(self.run_id, ip)

    # -- helpers --
    def _in(self, namespace: str, *args: str) -> None:
        _run([self.tools["ip"], "-n", namespace, *args])

    def _bridge(self, namespace: str, name: str) -> None:
        self._in(namespace, "link", "add", name, "type", "bridge")
        self._in(namespace, "link", "set", name, "up")

    def _attach(self, namespace: str, port: str, bridge: str) -> None:
        self._in(namespace, "link", "set", port, "master", bridge)
        self._in(namespace, "link", "set", port, "up")

    def _link(self, name: str, peer: str, namespace: str, peer_namespace: str | None = None,
              root: bool = False) -> None:
        """A veth pair: `name` in `namespace` (or in the root namespace with root), `peer` in
        `peer_namespace` (default: `namespace`)."""
        where = [] if root else ["-n", namespace]
        _run([self.tools["ip"], *where, "link", "add", name, "type", "veth", "peer", "name", peer,
              "netns", peer_namespace or namespace])


def leftovers(run_id: str, ip: str = "ip") -> list[str]:
    """The namespaces and the root link of run `run_id` that exist now."""
    found = [name for name in _namespaces(ip) if name.startswith(f"{NAME_PREFIX}-{run_id}-")]
    link = f"{LINK_PREFIX}{run_id}"
    if _run([ip, "link", "show", link], check=False).returncode == 0:
        found.append(link)
    return found


def wait_gone(run_id: str, timeout_s: float = 10.0) -> list[str]:
    """Wait (at most timeout_s) until nothing of run `run_id` exists; returns what still does."""
    deadline = time.monotonic() + timeout_s
    while (left := leftovers(run_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


if __name__ == "__main__":      # python -m multipod.controller.launch.netns: clean up after killed runs
    print("\n".join(clean_stale()) or "nothing stale", file=sys.stderr)
