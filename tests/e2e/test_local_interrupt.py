"""Ctrl-C during `multipod local` stops the controller and every worker promptly."""
import signal
import subprocess
import time

from tests.helpers import ROOT, TINY, cli_argv, cli_env, pid_alive, worker_pids


def test_ctrl_c_stops_everything(tmp_path):
    proc = subprocess.Popen(cli_argv("local", "--pods", "2", "--devices-per-pod", "1",
                                     "--config", TINY, "--steps", "100000", "--run-dir", str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)
    try:
        # Wait until training is under way (metrics are being written), then interrupt.
        deadline = time.monotonic() + 180
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        pids = worker_pids(tmp_path)
        assert all(pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        # A deadline against a hang, not a speed test: the shutdown closes TensorBoard's writer
        # and gives the workers a grace period, which takes long on a loaded machine.
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "orphan workers left after Ctrl-C"
