"""One host of one pod under Ray (`multipod ray`): the actor's side.

`WorkerHost` is the class that controller/launch/ray_pods.py turns into a Ray actor, one per host,
in its pod's placement group. It does not run the worker inside the actor process: it starts
`multipod worker` as a child process (the simulated device count must be set before jax
initialises, and the worker keeps its own log, process group and shutdown path, exactly as under
`multipod local`), and it shares its fate with that child:
  - the child exits (crash, SIGKILL, a hung pod killed by the controller): the actor process
    exits too, so Ray restarts the actor (max_restarts), which starts a new worker;
  - the actor process dies: the child leaves on its own (`--exit-with-parent`), and the actor's
    next incarnation kills whatever is left of it before starting a new one.

Every incarnation gets the same constructor arguments, so it listens on the same ports, which
the launcher picked once on the host's node (`free_ports`, run in the same placement-group
bundle): the controller's and the peers' addresses stay valid and the restarted pod rejoins from
a live peer like a restarted `multipod local` worker. The auth token is a constructor argument,
handed to the child in its environment: it never appears on a command line.

This module imports neither ray nor jax: Ray imports it in the actor's process by name."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from multipod.protos.channels import TOKEN_ENV

PORT_FREE_TIMEOUT_S = 30.0   # how long a new incarnation waits for the old worker's ports


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """What one host's worker needs; the same for every incarnation of its actor."""
    run_id: str                 # names the node-local state of this run (pid file, port file)
    pod: int
    host: int
    hosts_per_pod: int
    listen_host: str            # 127.0.0.1 when the whole run is on the controller's machine, else the node's IP
    port: int                   # gRPC control plane
    dcn_port: int               # ZeroMQ data plane
    coordinator: str            # the pod's jax.distributed coordinator ("" for a pod of one host)
    devices: int                # simulated CPU devices (0: the devices jax finds)
    log_path: str               # the worker's log, RUN_DIR/worker-P[-host-H].log on the node's file system
    flags: tuple[str, ...] = ()  # further worker flags (--dcn-encrypt, --insecure, TLS files)
    env: tuple[tuple[str, str], ...] = ()   # environment passed on from the controller (MULTIPOD_*, JAX_*)
    spare: bool = False         # a replacement started with --spare (hot-swap); `pod` then counts the spares

    @property
    def name(self) -> str:
        return f"{'spare' if self.spare else 'pod'} {self.pod}" + (f" host {self.host}" if self.hosts_per_pod > 1
                                                                   else "")

    def command(self, port_file: pathlib.Path) -> list[str]:
        """The worker's argv (no secret in it)."""
        who = ["--spare"] if self.spare else ["--pod-index", str(self.pod)]
        cmd = [sys.executable, "-m", "multipod.cli", "worker", *who,
               "--listen", f"{self.listen_host}:{self.port}", "--dcn-listen", f"{self.listen_host}:{self.dcn_port}",
               "--devices", str(self.devices), "--port-file", str(port_file), "--exit-with-parent"]
        if self.hosts_per_pod > 1:
            cmd += ["--host-index", str(self.host), "--hosts-per-pod", str(self.hosts_per_pod),
                    "--pod-coordinator", self.coordinator]
        return cmd + list(self.flags)


def free_ports(count: int) -> tuple[str, list[int]]:
    """(this node's IP, `count` TCP ports nothing listens on right now, below the kernel's
    ephemeral range so that no connection takes one before the actor's worker binds it:
    controller/launch/ports.py): run as a Ray task in a host's placement-group bundle, so the
    ports are free on the node where its actor will run."""
    import ray  # only ever called inside a Ray task

    from multipod.controller.launch.ports import free_ports as free_on_this_node
    return ray.util.get_node_ip_address(), free_on_this_node(count, host="")


class WorkerHost:
    """One host's worker process, owned by a Ray actor (see the module docstring)."""

    def __init__(self, spec: HostSpec, token: str):
        self.spec = spec
        self.state_dir = pathlib.Path(tempfile.gettempdir()) / f"multipod-ray-{os.getuid()}" / spec.run_id
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{'spare' if spec.spare else 'pod'}-{spec.pod}-host-{spec.host}"
        self.port_file = self.state_dir / f"{stem}.port"
        self.pid_file = self.state_dir / f"{stem}.pid"
        self._stopping = threading.Event()
        restarted = self._kill_previous()
        log_path = pathlib.Path(spec.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("a")
        import ray
        self.node_ip = ray.util.get_node_ip_address()
        self._note(f"{'restarted ' if restarted else ''}ray actor (pid {os.getpid()}) on node {self.node_ip}: "
                   f"starting {spec.name}'s worker on {spec.listen_host}:{spec.port}")
        self._wait_ports_free()
        self.port_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env.update(spec.env)
        if spec.devices:
            env.pop("XLA_FLAGS", None)   # the worker sets its own simulated device count
        env[TOKEN_ENV] = token           # the environment, never argv: argv is world-readable
        self.proc = subprocess.Popen(spec.command(self.port_file), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.pid_file.write_text(f"{self.proc.pid}\n")
        threading.Thread(target=self._watch, daemon=True, name="worker-watch").start()

    def _note(self, line: str) -> None:
        self.log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.spec.name} ray: {line}\n")
        self.log.flush()

    def _kill_previous(self) -> bool:
        """Kill the worker of this host's previous incarnation if it still runs (a hung one, or
        one still shutting down after its actor died); True if there was a previous one."""
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            return False
        try:   # only our own worker: its command line names this run's port file
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return True
        if str(self.port_file) in cmdline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return True

    def _wait_ports_free(self) -> None:
        """The ports are this host's for the whole run; a previous worker may still hold them for
        a moment. RuntimeError naming the port after PORT_FREE_TIMEOUT_S."""
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        for port in (self.spec.port, self.spec.dcn_port):
            while True:
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC and ZeroMQ bind
                    try:
                        s.bind((self.spec.listen_host, port))
                        break
                    except OSError as exc:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{self.spec.name}: port {port} is still in use after "
                                               f"{PORT_FREE_TIMEOUT_S:g}s: {exc}") from None
                time.sleep(0.1)

    def _watch(self) -> None:
        code = self.proc.wait()
        if self._stopping.is_set():
            return
        self._note(f"worker (pid {self.proc.pid}) exited with code {code}; the actor exits so that Ray restarts it")
        self.log.close()
        os._exit(1)   # an unexpected exit: Ray restarts the actor (an orderly exit_actor would not)

    def ready(self, timeout_s: float) -> dict:
        """Wait until the worker serves; its addresses and pids. RuntimeError (with the end of
        its log) if it exits or does not serve within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name}'s worker exited with code {self.proc.returncode} while "
                                   f"starting; log {self.spec.log_path} on {self.node_ip}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.spec.name}'s worker did not serve within {timeout_s:g}s; "
                                   f"log {self.spec.log_path} on {self.node_ip}:\n{self._tail()}")
            time.sleep(0.05)
        return {"address": f"{self.spec.listen_host}:{self.spec.port}", "node": self.node_ip,
                "pid": self.proc.pid, "actor_pid": os.getpid()}

    def _tail(self) -> str:
        try:
            return pathlib.Path(self.spec.log_path).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def ping(self) -> tuple[str, int]:
        """(this node's IP, the worker's pid) while the worker process runs, else ("", pid)."""
        return (self.node_ip if self.proc.poll() is None else ""), self.proc.pid

    def kill_worker(self, pid: int | None = None) -> None:
        """SIGKILL the worker (e.g. one that hangs): the actor then exits and Ray restarts it.
        With pid, only if that is still the worker: a call meant for an incarnation that has
        died since must not kill its successor."""
        if pid is not None and pid != self.proc.pid:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the worker for good (the end of the run): SIGTERM, then SIGKILL after grace_s."""
        self._stopping.set()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill_worker()
                self.proc.wait(timeout=5)
            except (ProcessLookupError, PermissionError):
                pass
        self.pid_file.unlink(missing_ok=True)
        self.port_file.unlink(missing_ok=True)
        pathlib.Path(f"{self.port_file}.dcn").unlink(missing_ok=True)
        try:
            self.state_dir.rmdir()   # the last host of the run on this node leaves nothing behind
        except OSError:
            pass
        self.log.close()
