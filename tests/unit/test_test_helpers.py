"""tests/helpers.py's process helpers: a number that once was a worker's is only signalled while
it still names that worker. tests/crash_report.py names a test process that died when xdist
ended the run with an internal error instead of reporting the crash."""
import signal
import subprocess
import sys
import threading
import time
import types

from tests import crash_report
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


def test_an_internal_error_names_the_dead_test_process_and_the_test_it_had_not_finished(monkeypatch, capsys):
    """xdist's controller keeps each worker's tests in its scheduler (assigned_work: file ->
    {test: finished}); a worker that died is named with its signal and its first unfinished test,
    and a live one is not named."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)

        class Node:     # xdist's WorkerController, as far as the hook reads it (and hashable)
            def __init__(self, name, popen):
                self.gateway = types.SimpleNamespace(id=name, _io=types.SimpleNamespace(popen=popen))
        gw0, gw1 = Node("gw0", live), Node("gw1", dead)
        scheduler = types.SimpleNamespace(nodes=[gw0, gw1], assigned_work={
            gw0: {"a.py": {"a.py::one": False}},
            gw1: {"b.py": {"b.py::first": True, "b.py::killed": False, "b.py::after": False}}})
        plugins = {"dsession": types.SimpleNamespace(sched=scheduler)}
        config = types.SimpleNamespace(pluginmanager=types.SimpleNamespace(getplugin=plugins.get))
        monkeypatch.setattr(crash_report, "_config", config)
        crash_report.pytest_internalerror(None, None)
    finally:
        live.kill()
        live.wait(30)
    err = capsys.readouterr().err
    assert f"test process gw1 (pid {dead.pid}) ended with signal SIGKILL while running 'b.py::killed'" in err
    assert "gw0" not in err
