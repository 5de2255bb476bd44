"""Simulated pods on one machine: each pod worker is a subprocess with its own simulated device
count. Started with subprocess (never a fork of a process that imported jax), in their own
process group, and always stopped: on success, on error, on Ctrl-C, and (through the workers'
parent watch) even when the controller itself is killed.

LocalPods also supervises its workers: a worker that dies is started again on the same port (so
its peers' addresses stay valid), up to `max_restarts` times; the controller then restores every
pod to the last checkpoint (controller/recovery.py).
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from multipod.protos.transport import TOKEN_ENV, Security, default_security


class LaunchError(RuntimeError):
    """A local worker failed to start or died."""


class LocalPods:
    """Start `num_pods` workers on 127.0.0.1; use as a context manager."""

    def __init__(self, num_pods: int, devices_per_pod: int | list[int], log_dir: pathlib.Path,
                 start_timeout_s: float = 60.0, security: Security | None = None, supervise: bool = False,
                 max_restarts: int = 3, dcn_encrypt: bool = False):
        """devices_per_pod: one count for every pod, or one per pod (tests use that to make pods
        that disagree). security: the workers' token/TLS (default: this process's); without a
        token they serve unauthenticated. supervise: restart dead workers (at most max_restarts
        restarts in all). dcn_encrypt: CURVE-encrypt the workers' data planes."""
        if num_pods < 1:
            raise ValueError("--pods must be >= 1")
        counts = devices_per_pod if isinstance(devices_per_pod, list) else [devices_per_pod] * num_pods
        if len(counts) != num_pods or min(counts) < 1:
            raise ValueError("--devices-per-pod must be >= 1 (one count, or one per pod)")
        self.num_pods, self.devices_per_pod, self.device_counts = num_pods, devices_per_pod, counts
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.dcn_listen: list[str] = []     # each worker's data-plane HOST:PORT (kept across restarts)
        self.dcn_encrypt = dcn_encrypt
        self._logs = []
        self.security = security or default_security()
        self.max_restarts = max_restarts
        self.restarts = 0
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor = (threading.Thread(target=self._supervise, daemon=True, name="supervisor")
                            if supervise else None)

    def __enter__(self) -> LocalPods:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_path(self, pod: int) -> pathlib.Path:
        return self.log_dir / f"worker-{pod}.log"

    def _spawn(self, pod: int, listen: str, port_file: pathlib.Path, mode: str,
               dcn_listen: str = "127.0.0.1:0") -> subprocess.Popen:
        port_file.unlink(missing_ok=True)
        log = self.log_path(pod).open(mode)
        self._logs.append(log)
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)   # the worker sets its own device count
        env.pop(TOKEN_ENV, None)
        # A persistent compilation cache per run: a restarted worker reloads its compiled step
        # instead of compiling it again, so recovery is quicker.
        if "JAX_COMPILATION_CACHE_DIR" not in env:
            env["JAX_COMPILATION_CACHE_DIR"] = str((self.log_dir / ".jax-cache").absolute())
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        cmd = [sys.executable, "-m", "multipod.cli", "worker", "--pod-index", str(pod),
               "--listen", listen, "--devices", str(self.device_counts[pod]),
               "--port-file", str(port_file), "--exit-with-parent", "--dcn-listen", dcn_listen]
        if self.dcn_encrypt:
            cmd.append("--dcn-encrypt")
        if self.security.token:
            env[TOKEN_ENV] = self.security.token   # the environment, not argv: argv is world-readable
        else:
            cmd.append("--insecure-no-auth")
        for flag, value in (("--tls-cert", self.security.tls_cert), ("--tls-key", self.security.tls_key),
                            ("--tls-ca", self.security.tls_ca), ("--tls-server-name", self.security.tls_server_name)):
            if value:
                cmd += [flag, value]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)

    def _wait_port(self, pod: int, port_file: pathlib.Path, deadline: float) -> int:
        while not (port_file.exists() and port_file.read_text().strip()):
            if self._stopping.is_set():
                raise LaunchError(f"pod {pod}: stopped while starting")
            self.check_alive(pod)
            if time.monotonic() > deadline:
                raise LaunchError(f"pod {pod} did not start listening within {self.start_timeout_s:g}s; "
                                  f"see {self.log_path(pod)}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        port_file.unlink(missing_ok=True)
        dcn_file = pathlib.Path(f"{port_file}.dcn")     # written before the port file
        dcn = dcn_file.read_text().strip().split("://", 1)[-1]
        dcn_file.unlink(missing_ok=True)
        if pod < len(self.dcn_listen):
            self.dcn_listen[pod] = dcn
        else:
            self.dcn_listen.append(dcn)
        return port

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port_files = [self.log_dir / f".worker-{pod}.port" for pod in range(self.num_pods)]
        for pod in range(self.num_pods):
            self.procs.append(self._spawn(pod, "127.0.0.1:0", port_files[pod], "w"))
        deadline = time.monotonic() + self.start_timeout_s
        for pod, port_file in enumerate(port_files):
            self.addresses.append(f"127.0.0.1:{self._wait_port(pod, port_file, deadline)}")
        if self._supervisor is not None:
            self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            for pod, proc in enumerate(list(self.procs)):
                if proc.poll() is not None and not self._stopping.is_set():
                    try:
                        self.restart(pod)
                    except LaunchError as exc:   # e.g. the new worker died while starting
                        print(f"supervisor: {exc}", file=sys.stderr, flush=True)
                        if self.restarts >= self.max_restarts:
                            return     # out of restarts: the controller reports the dead pod

    def restart(self, pod: int) -> None:
        """Start pod `pod` again on its old port (killing the old process first if it still runs,
        e.g. because it hangs). LaunchError once max_restarts restarts have been used."""
        with self._lock:
            old = self.procs[pod]
            if old.poll() is None:
                _signal_group(old, signal.SIGKILL)
                old.wait(timeout=10)
            if self._stopping.is_set():
                return
            if self.restarts >= self.max_restarts:
                raise LaunchError(f"pod {pod} worker (pid {old.pid}) exited with code {old.returncode}; "
                                  f"not restarted: {self.restarts} restart(s) used, the limit is {self.max_restarts}")
            self.restarts += 1
            print(f"supervisor: pod {pod} worker (pid {old.pid}) exited with code {old.returncode}; "
                  f"restarting it on {self.addresses[pod]} (restart {self.restarts}/{self.max_restarts})",
                  file=sys.stderr, flush=True)
            port_file = self.log_dir / f".worker-{pod}.port"
            # Same port: the peers' and the controller's addresses stay valid. The port was freed
            # when the old process died; gRPC binds with SO_REUSEADDR.
            self.procs[pod] = self._spawn(pod, self.addresses[pod], port_file, "a", self.dcn_listen[pod])
            self._wait_port(pod, port_file, time.monotonic() + self.start_timeout_s)

    def kill(self, pod: int) -> None:
        """SIGKILL a worker that hangs, so the supervisor starts it again."""
        _signal_group(self.procs[pod], signal.SIGKILL)

    def check_alive(self, only: int | None = None) -> None:
        """LaunchError naming the first worker that has exited, with the end of its log."""
        for pod, proc in enumerate(self.procs):
            if only is not None and pod != only:
                continue
            if proc.poll() is not None:
                tail = self.log_path(pod).read_text(errors="replace")[-2000:]
                raise LaunchError(f"pod {pod} worker (pid {proc.pid}) exited with code {proc.returncode}; "
                                  f"log {self.log_path(pod)}:\n{tail}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after the grace period."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor.is_alive():
            self._supervisor.join(timeout=grace_s + 10)
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
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
