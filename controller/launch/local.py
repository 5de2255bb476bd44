"""Simulated pods on one machine: each pod worker is a subprocess with its own simulated device
count. Started with subprocess (never a fork of a process that imported jax), in their own
process group, and always stopped: on success, on error, on Ctrl-C, and (through the workers'
parent watch) even when the controller itself is killed.

A pod may have several hosts (hosts_per_pod): one worker process per host, which form one
jax.distributed cluster of their own (host 0 runs its coordinator on a port picked per pod).

LocalPods also supervises its workers: a worker that dies is started again on the same port (so
its peers' addresses stay valid), up to `max_restarts` times; the controller then has the
survivors take its shard (or restores every pod to the last checkpoint). When one host of a pod
dies, the pod's other hosts are stopped and all of them start again: a jax.distributed cluster
cannot take a lost host back.

With spares, standby pods (worker --spare) start beside the pods, at their own ports (and, under
NetnsPods, their own addresses), and a dead worker is not restarted: a spare takes its slot
(hot-swap, controller/components/failover.py), and `swapped` tells LocalPods which processes
serve the slot from then on.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from multipod.controller.launch.ports import free_ports
from multipod.protos.channels import TOKEN_ENV, Security, default_security


class LaunchError(RuntimeError):
    """A local worker failed to start or died."""


class Launched:
    """Workers started by a launcher: start() on entering, stop() on leaving, and stop() also when
    start() fails halfway (whatever it had started goes)."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalPods(Launched):
    """Start `num_pods` pods of `hosts_per_pod` workers each on 127.0.0.1; use as a context manager.

    addresses[p] is pod p's address as the controller takes it: its hosts' HOST:PORT joined with
    "," (one HOST:PORT for a one-host pod, as before); host_addresses[p][h] is one host's;
    `workers` is the `--workers` string for all of them."""

    def __init__(self, num_pods: int, devices_per_pod: int | list, log_dir: pathlib.Path,
                 start_timeout_s: float = 60.0, security: Security | None = None, supervise: bool = False,
                 max_restarts: int = 3, dcn_encrypt: bool = False, hosts_per_pod: int = 1, spares: int = 0):
        """devices_per_pod: each pod's device count (all its hosts together; split evenly over
        them), one for every pod, or one per pod (tests use that to make pods that disagree); a
        pod's entry may also be a list of one count per host. security: the workers' token/TLS
        (default: this process's); without a token they serve unauthenticated. supervise: restart
        dead workers (at most max_restarts restarts in all; a pod of several hosts is restarted
        as a whole). dcn_encrypt: CURVE-encrypt the workers' data planes. hosts_per_pod: worker
        processes per pod, which form one jax.distributed cluster (host 0 runs its coordinator on
        a free port, the same one after every restart). spares: standby pods started beside them,
        with pod 0's device count (entries num_pods.. of the per-pod lists below)."""
        if num_pods < 1:
            raise ValueError("--pods must be >= 1")
        if spares < 0:
            raise ValueError("--spares must be >= 0")
        if hosts_per_pod < 1:
            raise ValueError("--hosts-per-pod must be >= 1")
        counts = devices_per_pod if isinstance(devices_per_pod, list) else [devices_per_pod] * num_pods
        if len(counts) != num_pods:
            raise ValueError(f"--devices-per-pod: {len(counts)} count(s) for {num_pods} pods "
                             f"(one count, or one per pod)")
        counts = list(counts) + [counts[0]] * spares
        self.host_devices: list[list[int]] = []     # [pod][host]: each worker's simulated device count
        for pod, count in enumerate(counts):
            per_host = list(count) if isinstance(count, list) else None
            if per_host is not None and len(per_host) != hosts_per_pod:
                raise ValueError(f"pod {pod}: {len(per_host)} device count(s) for {hosts_per_pod} hosts")
            if min(per_host or [count]) < 1:
                raise ValueError("--devices-per-pod and --devices-per-host must be >= 1")
            if per_host is None:
                if count % hosts_per_pod:
                    raise ValueError(f"pod {pod}: {count} devices do not split evenly over {hosts_per_pod} hosts "
                                     f"(--devices-per-pod must be --hosts-per-pod x --devices-per-host)")
                per_host = [count // hosts_per_pod] * hosts_per_pod
            self.host_devices.append(per_host)
        self.num_pods, self.hosts_per_pod, self.devices_per_pod = num_pods, hosts_per_pod, devices_per_pod
        self.spares = spares
        self.total = num_pods + spares            # entries of the per-pod lists: the pods, then the spares
        self.slot_of = list(range(num_pods))      # slot -> the entry whose processes serve it (swapped)
        self.device_counts = [sum(hosts) for hosts in self.host_devices]   # per pod
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.host_procs: list[list[subprocess.Popen]] = []   # [pod][host]
        self.host_addresses: list[list[str]] = []            # [pod][host]: gRPC HOST:PORT
        self.dcn_listen: list[list[str]] = []   # [pod][host]: data-plane HOST:PORT (kept across restarts)
        self.coordinators: list[str] = []       # [pod]: the pod's jax.distributed coordinator ("" for one host)
        self.dcn_encrypt = dcn_encrypt
        self._logs = []
        self.security = security or default_security()
        self.max_restarts = max_restarts
        self.restarts = 0
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        # With spares a dead worker stays dead: a spare takes its slot.
        self._supervisor = (threading.Thread(target=self._supervise, daemon=True, name="supervisor")
                            if supervise and not spares else None)

    @property
    def multi_host(self) -> bool:
        return self.hosts_per_pod > 1

    @property
    def addresses(self) -> list[str]:
        """Pod p's address for the controller: its hosts' HOST:PORT joined with ","."""
        return [",".join(hosts) for hosts in self.host_addresses[:self.num_pods]]

    @property
    def pod_host_addresses(self) -> list[list[str]]:
        """[pod][host]: the pods' hosts' addresses (without the spares'), for connect()."""
        return self.host_addresses[:self.num_pods]

    @property
    def spare_host_addresses(self) -> list[list[str]]:
        """[spare][host]: the standby pods' hosts' addresses."""
        return self.host_addresses[self.num_pods:]

    @property
    def spare_addresses(self) -> list[str]:
        return [",".join(hosts) for hosts in self.spare_host_addresses]

    def swapped(self, slot: int, address: str) -> None:
        """The spare at `address` (its hosts' joined with ",") serves `slot` from now on: kill()
        of the slot reaches its processes."""
        for entry, hosts in enumerate(self.host_addresses):
            if ",".join(hosts) == address:
                replaced, self.slot_of[slot] = self.slot_of[slot], entry
                for proc in self.host_procs[replaced]:      # a pod's host that outlived the one that died
                    if proc.poll() is None:
                        _signal_group(proc, signal.SIGKILL)

    @property
    def workers(self) -> str:
        """The `--workers` value for these pods (";" between pods, "," between hosts)."""
        return (";" if self.multi_host else ",").join(self.addresses)

    @property
    def procs(self) -> list[subprocess.Popen]:
        """Each pod's host-0 process (its only one in a pod of one host); host_procs has them all."""
        return [hosts[0] for hosts in self.host_procs[:self.num_pods]]

    def _entry_name(self, pod: int) -> tuple[str, int]:
        """("worker", pod) for a pod, ("spare", i) for the i-th spare."""
        return ("worker", pod) if pod < self.num_pods else ("spare", pod - self.num_pods)

    def name(self, pod: int, host: int = 0) -> str:
        kind, index = self._entry_name(pod)
        return f"{'pod' if kind == 'worker' else 'spare'} {index}" + (f" host {host}" if self.multi_host else "")

    def log_path(self, pod: int, host: int = 0) -> pathlib.Path:
        kind, index = self._entry_name(pod)
        if not self.multi_host:
            return self.log_dir / f"{kind}-{index}.log"
        return self.log_dir / f"{kind}-{index}-host-{host}.log"

    def _port_file(self, pod: int, host: int) -> pathlib.Path:
        kind, index = self._entry_name(pod)
        if not self.multi_host:
            return self.log_dir / f".{kind}-{index}.port"
        return self.log_dir / f".{kind}-{index}-host-{host}.port"

    def _spawn(self, pod: int, host: int, listen: str, mode: str, dcn_listen: str = "127.0.0.1:0") -> subprocess.Popen:
        port_file = self._port_file(pod, host)
        port_file.unlink(missing_ok=True)
        log = self.log_path(pod, host).open(mode)
        self._logs.append(log)
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)   # the worker sets its own device count
        env.pop(TOKEN_ENV, None)
        # The workers' compilation cache is theirs to choose (pod_worker/compile_cache.py): the
        # machine's, under the cache root this environment names, so every run here shares it.
        cmd = self.command(pod, host, listen, port_file, dcn_listen)
        if self.security.token:
            env[TOKEN_ENV] = self.security.token   # the environment, not argv: argv is world-readable
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)

    def command(self, pod: int, host: int, listen: str, port_file: pathlib.Path, dcn_listen: str) -> list[str]:
        """The argv of one host's worker."""
        who = ["--pod-index", str(pod)] if pod < self.num_pods else ["--spare"]
        cmd = [sys.executable, "-m", "multipod.cli", "worker", *who, "--listen", listen,
               "--devices", str(self.host_devices[pod][host]),
               "--port-file", str(port_file), "--exit-with-parent", "--dcn-listen", dcn_listen]
        if self.multi_host:
            cmd += ["--host-index", str(host), "--hosts-per-pod", str(self.hosts_per_pod),
                    "--pod-coordinator", self.coordinators[pod]]
        if self.dcn_encrypt:
            cmd.append("--dcn-encrypt")
        if not self.security.token:
            cmd.append("--insecure-no-auth")
        for flag, value in (("--tls-cert", self.security.tls_cert), ("--tls-key", self.security.tls_key),
                            ("--tls-ca", self.security.tls_ca), ("--tls-server-name", self.security.tls_server_name)):
            if value:
                cmd += [flag, value]
        return cmd

    def _wait_port(self, pod: int, host: int, deadline: float) -> int:
        """The gRPC port the worker wrote to its port file (its data-plane address is kept)."""
        port_file = self._port_file(pod, host)
        while not (port_file.exists() and port_file.read_text().strip()):
            if self._stopping.is_set():
                raise LaunchError(f"{self.name(pod, host)}: stopped while starting")
            self.check_alive(pod)    # a pod's hosts wait for each other: any one dying ends the wait
            if time.monotonic() > deadline:
                raise LaunchError(f"{self.name(pod, host)} did not start listening within {self.start_timeout_s:g}s; "
                                  f"see {self.log_path(pod, host)}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        port_file.unlink(missing_ok=True)
        dcn_file = pathlib.Path(f"{port_file}.dcn")     # written before the port file
        self.dcn_listen[pod][host] = dcn_file.read_text().strip().split("://", 1)[-1]
        dcn_file.unlink(missing_ok=True)
        return port

    def listen_host(self, pod: int, host: int) -> str:
        """The address a host's worker listens on (both planes; host 0's also serves the pod's
        coordinator): loopback here, a namespace's own address under NetnsPods."""
        return "127.0.0.1"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        hosts = range(self.hosts_per_pod)
        ports = free_ports(self.total if self.multi_host else 0)
        self.coordinators = [f"{self.listen_host(pod, 0)}:{ports[pod]}" if self.multi_host else ""
                             for pod in range(self.total)]
        self.dcn_listen = [[f"{self.listen_host(pod, host)}:0" for host in hosts] for pod in range(self.total)]
        for pod in range(self.total):
            self.host_procs.append([])
            for host in hosts:
                self.host_procs[pod].append(self._spawn(pod, host, f"{self.listen_host(pod, host)}:0", "w",
                                                        self.dcn_listen[pod][host]))
        deadline = time.monotonic() + self.start_timeout_s
        for pod in range(self.total):
            ports = [self._wait_port(pod, host, deadline) for host in hosts]
            self.host_addresses.append([f"{self.listen_host(pod, host)}:{port}" for host, port in enumerate(ports)])
        if self._supervisor is not None:
            self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            for pod, procs in enumerate(list(self.host_procs)):
                if any(proc.poll() is not None for proc in procs) and not self._stopping.is_set():
                    try:
                        self.restart(pod)
                    except LaunchError as exc:   # e.g. the new worker died while starting
                        print(f"supervisor: {exc}", file=sys.stderr, flush=True)
                        if self.restarts >= self.max_restarts:
                            return     # out of restarts: the controller reports the dead pod

    def restart(self, pod: int) -> None:
        """Start pod `pod` again: every one of its hosts, on their old ports and the pod's old
        coordinator port (killing what still runs first, e.g. a worker that hangs, or the hosts
        that outlived one that died: a jax.distributed cluster cannot take a host back).
        LaunchError once max_restarts restarts have been used."""
        with self._lock:
            old = list(self.host_procs[pod])
            exited = [h for h, proc in enumerate(old) if proc.poll() is not None]
            for proc in old:
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGKILL)
            for proc in old:
                proc.wait(timeout=10)
            if self._stopping.is_set():
                return
            died = ", ".join(f"{self.name(pod, h)} worker (pid {old[h].pid}) exited with code {old[h].returncode}"
                             for h in exited or range(len(old)))
            if exited and len(exited) < len(old):
                died += f" (its {len(old) - len(exited)} other host(s) stopped: the pod restarts as a whole)"
            if self.restarts >= self.max_restarts:
                raise LaunchError(f"{died}; not restarted: {self.restarts} restart(s) used, "
                                  f"the limit is {self.max_restarts}")
            self.restarts += 1
            print(f"supervisor: {died}; restarting pod {pod} on {self.addresses[pod]} "
                  f"(restart {self.restarts}/{self.max_restarts})", file=sys.stderr, flush=True)
            # Same ports: the peers' and the controller's addresses stay valid. The ports were
            # freed when the old processes died; gRPC binds with SO_REUSEADDR.
            for host in range(self.hosts_per_pod):
                self.host_procs[pod][host] = self._spawn(pod, host, self.host_addresses[pod][host], "a",
                                                         self.dcn_listen[pod][host])
            deadline = time.monotonic() + self.start_timeout_s
            for host in range(self.hosts_per_pod):
                self._wait_port(pod, host, deadline)

    def kill(self, pod: int, host: int | None = None) -> None:
        """SIGKILL every host of a pod (or only `host`), e.g. one that hangs, so the supervisor
        starts the pod again."""
        for h, proc in enumerate(self.host_procs[self.slot_of[pod]]):
            if host is None or h == host:
                _signal_group(proc, signal.SIGKILL)

    def check_alive(self, only: int | None = None) -> None:
        """LaunchError naming the first worker that has exited, with the end of its log."""
        for pod, procs in enumerate(self.host_procs):
            if only is not None and pod != only:
                continue
            for host, proc in enumerate(procs):
                if proc.poll() is not None:
                    log = self.log_path(pod, host)
                    tail = log.read_text(errors="replace")[-2000:]
                    raise LaunchError(f"{self.name(pod, host)} worker (pid {proc.pid}) exited with code "
                                      f"{proc.returncode}; log {log}:\n{tail}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after the grace period."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor.is_alive():
            self._supervisor.join(timeout=grace_s + 10)
        procs = [proc for hosts in self.host_procs for proc in hosts]
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=5)
        for log in self._logs:
            log.close()
        self._logs.clear()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
