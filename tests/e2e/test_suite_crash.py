"""The suite's own pytest options, on a crash: a test process killed mid-test ends the run within
seconds (not a scheduler that waits for ever), with the test it ran and how the process ended.

It runs pytest as README.md's test command does (the addopts of pyproject.toml, read from it)
over a few throwaway modules, one of which SIGKILLs its own test process."""
import os
import subprocess
import sys
import tomllib

from tests.helpers import ROOT

_QUICK = "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n"
_KILLED = ("import os, signal\n\n\ndef test_before():\n    pass\n\n\n"
           "def test_killed():\n    os.kill(os.getpid(), signal.SIGKILL)\n\n\n"
           "def test_after():\n    pass\n")


def test_a_killed_test_process_ends_the_run_and_is_named_with_its_signal(tmp_path):
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = {options['addopts']}\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.crash_report"]\n')
    for name in ("test_1", "test_2", "test_3"):      # modules finished before the crash
        (tmp_path / f"{name}.py").write_text(_QUICK)
    (tmp_path / "test_4_killed.py").write_text(_KILLED)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    # xdist ends such a run one of two ways: it sees the worker go down (exit code 1), or it was
    # sending the worker its next tests when it died, and the send fails (INTERNALERROR, code 3).
    # Either way the run ends, and the killed test and its signal are named.
    assert done.returncode in (1, 3), out
    if done.returncode == 1:
        assert "crashed while running 'test_4_killed.py::test_killed'" in out, out
        assert "ended with signal SIGKILL" in out, out
        assert "worker restarting disabled" in out, out
    else:
        assert "INTERNALERROR" in out and "cannot send" in out, out
        assert "ended with signal SIGKILL while running 'test_4_killed.py::test_killed'" in out, out
