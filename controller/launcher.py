"""Simulated pods on one machine: each pod worker is a subprocess with its own simulated device
count. Started with subprocess (never a fork of a process that imported jax), in their own
process group, and always stopped: on success, on error, on Ctrl-C, and (through the workers'
parent watch) even when the controller itself is killed.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time


class LaunchError(RuntimeError):
    """A local worker failed to start or died."""


class LocalPods:
    """Start `num_pods` workers on 127.0.0.1; use as a context manager."""

    def __init__(self, num_pods: int, devices_per_pod: int | list[int], log_dir: pathlib.Path,
                 start_timeout_s: float = 60.0):
        """devices_per_pod: one count for every pod, or one per pod (tests use that to make pods
        that disagree)."""
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
        self._logs = []

    def __enter__(self) -> "LocalPods":
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

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port_files = []
        for pod in range(self.num_pods):
            port_file = self.log_dir / f".worker-{pod}.port"
            port_file.unlink(missing_ok=True)
            port_files.append(port_file)
            log = self.log_path(pod).open("w")
            self._logs.append(log)
            env = dict(os.environ)
            env.pop("XLA_FLAGS", None)   # the worker sets its own device count
            cmd = [sys.executable, "-m", "controller.cli", "worker", "--pod-index", str(pod),
                   "--listen", "127.0.0.1:0", "--devices", str(self.device_counts[pod]),
                   "--port-file", str(port_file), "--exit-with-parent"]
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, start_new_session=True))
        deadline = time.monotonic() + self.start_timeout_s
        for pod, port_file in enumerate(port_files):
            while not (port_file.exists() and port_file.read_text().strip()):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise LaunchError(f"pod {pod} did not start listening within {self.start_timeout_s:g}s; "
                                      f"see {self.log_path(pod)}")
                time.sleep(0.05)
            self.addresses.append(f"127.0.0.1:{int(port_file.read_text())}")
            port_file.unlink(missing_ok=True)

    def check_alive(self) -> None:
        """LaunchError naming the first worker that has exited, with the end of its log."""
        for pod, proc in enumerate(self.procs):
            if proc.poll() is not None:
                tail = self.log_path(pod).read_text(errors="replace")[-2000:]
                raise LaunchError(f"pod {pod} worker (pid {proc.pid}) exited with code {proc.returncode}; "
                                  f"log {self.log_path(pod)}:\n{tail}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after the grace period."""
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
