"""The worker processes a benchmark script starts itself (bench/failover.py, bench/scaling.py):
waiting for each to write its port, and stopping them all at the end."""
from __future__ import annotations

import pathlib
import subprocess
import time


def wait_for_port(proc: subprocess.Popen, port_file: pathlib.Path, deadline: float) -> str | None:
    """The worker's address ("127.0.0.1:PORT") once it has written its port to `port_file`
    (`multipod worker --port-file`); None if it exits first or time.monotonic() passes `deadline`."""
    while not (port_file.exists() and port_file.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            return None
        time.sleep(0.05)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then wait up to `grace_s` for each in turn and
    SIGKILL the ones still running after that."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
