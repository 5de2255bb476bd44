"""tests/helpers.py's process helpers: a number that once was a worker's is only signalled while
it still names that worker."""
import subprocess
import sys
import threading
import time

from tests.helpers import hold_process, kill_held, pid_alive


def test_pid_alive_counts_processes_not_threads_and_not_zombies():
    started, release = threading.Event(), threading.Event()
    tid = []

    def run():
        tid.append(threading.get_native_id())
        started.set()
        release.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert started.wait(30)
        assert not pid_alive(tid[0])            # kill(2) would reach this process through it
    finally:
        release.set()
        thread.join(30)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_pid = child.pid
    deadline = time.monotonic() + 30
    while not _is_zombie(child_pid):             # exited, not yet reaped
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert not pid_alive(child_pid)
    child.wait(30)


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_held_process_is_killed_once_and_a_reaped_one_is_not_signalled():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    held = hold_process(child.pid)
    assert held is not None
    kill_held(held)
    assert child.wait(30) == -9
    again = subprocess.Popen([sys.executable, "-c", "pass"])
    held = hold_process(again.pid)
    again.wait(30)                               # reaped: its number is free for anyone
    kill_held(held)                              # goes nowhere, raises nothing
