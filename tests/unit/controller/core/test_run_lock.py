"""One controller per run directory (controller/core/run_lock.py), and what `multipod attach`
says when no controller runs the directory."""
import argparse
import os
import subprocess
import sys

import pytest

from multipod.controller.core.run_config import ConfigError
from multipod.controller.core.run_lock import RunDirLock, running_controller


def test_a_second_controller_on_a_run_directory_is_refused_naming_the_first(tmp_path):
    assert running_controller(tmp_path) is None
    with RunDirLock(tmp_path):
        assert running_controller(tmp_path) == os.getpid()
        with pytest.raises(ConfigError, match=rf"is being run by another controller now \(pid {os.getpid()}\)"):
            with RunDirLock(tmp_path):
                pass
        assert running_controller(tmp_path) == os.getpid()     # the refused one took nothing away
    assert running_controller(tmp_path) is None
    with RunDirLock(tmp_path):                                  # free again once the first is done
        pass


def test_a_controller_killed_outright_leaves_the_run_directory_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from multipod.controller.core.run_lock import RunDirLock\n"
                               f"with RunDirLock({str(tmp_path)!r}):\n"
                               "    print('held', flush=True); time.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert running_controller(tmp_path) == holder.pid
        holder.kill()
        holder.wait(timeout=30)
        assert running_controller(tmp_path) is None
        with RunDirLock(tmp_path):
            assert running_controller(tmp_path) == os.getpid()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_attach_says_whether_a_controller_runs_the_directory(tmp_path, capsys):
    from multipod.controller.commands import attach
    (tmp_path / "config.json").write_text("{}")
    assert attach(argparse.Namespace(run_dir=str(tmp_path), worker="a:1")) == 0
    assert "no controller is running it now: the offer is checked when the run is resumed" in capsys.readouterr().out
    with RunDirLock(tmp_path):
        assert attach(argparse.Namespace(run_dir=str(tmp_path), worker="b:1")) == 0
        assert "the controller checks it within a second" in capsys.readouterr().out
