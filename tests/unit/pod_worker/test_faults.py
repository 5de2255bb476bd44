"""The worker's test hooks (pod_worker/faults.py), where their timing is the point."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

# A worker's shape in small: the main thread waits (as the gRPC server's does) while a second
# thread hits the hang hook and, were it to go on, writes a marker at once.
_CHILD = """
import pathlib, sys, threading, time
from multipod.pod_worker import faults
marker = pathlib.Path(sys.argv[1])
def step():
    faults.hang_if_asked(2, 40)
    marker.write_text("went on")
threading.Thread(target=step).start()
time.sleep(60)
"""


def _state(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("attempt", range(5))
def test_the_hang_hook_stops_the_worker_before_its_thread_does_anything_more(tmp_path, attempt):
    marker = tmp_path / "marker"
    env = dict(os.environ, MULTIPOD_TEST_HANG="2:40")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(marker)], env=env)
    try:
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline, "the worker never stopped"
            time.sleep(0.01)
        time.sleep(0.2)      # were the thread still running, its marker would be there by now
        assert not marker.exists(), "the thread that asked for the hang went on after it"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
