"""A worker knows only its part of the config: one started where the controller's --data path does
not exist trains normally (the data path is the controller's concern, read on the controller's disk)."""
import json
import subprocess
import sys
import time

from tests.helpers import TINY, cli_env, run_cli


def test_a_worker_where_the_data_path_does_not_exist_trains_normally(tmp_path, monkeypatch):
    token = "token-for-the-remote-worker-test-0123"
    monkeypatch.setenv("MULTIPOD_AUTH_TOKEN", token)     # worker and controller share it
    worker_home, controller_home = tmp_path / "worker-home", tmp_path / "controller-home"
    worker_home.mkdir()
    corpus = controller_home / "corpus"           # relative to the controller only
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert not (worker_home / "corpus").exists()
    port_file = worker_home / "port"
    env = cli_env()
    with (worker_home / "worker.log").open("w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "multipod.cli", "worker", "--pod-index", "0",
                                   "--listen", "127.0.0.1:0", "--devices", "1", "--port-file", str(port_file)],
                                  cwd=worker_home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not (port_file.exists() and port_file.read_text().strip()):
                assert worker.poll() is None, (worker_home / "worker.log").read_text()
                assert time.monotonic() < deadline, "the worker did not start listening"
                time.sleep(0.1)
            address = f"127.0.0.1:{port_file.read_text().strip()}"
            result = run_cli("train", "--workers", address, "--config", TINY, "--data", "corpus", "--steps", "3",
                             "--set", "sample.tokens=0", "--set", "eval.batches=1", "--run-dir", "run",
                             "--checkpoint-dir", str(tmp_path / "shared-checkpoints"), cwd=controller_home,
                             timeout=300)
        finally:
            worker.terminate()
            code = worker.wait(timeout=30)
    log_text = (worker_home / "worker.log").read_text()
    assert result.returncode == 0, result.stdout + result.stderr + log_text
    # SIGTERM stops the worker in order; it exits 0 without the interpreter's teardown
    # (main.exit_served), its log flushed to the last line.
    assert code == 0, log_text
    assert log_text.rstrip().splitlines()[-1].endswith("pod 0 stopped"), log_text[-2000:]
    summary = json.loads((controller_home / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["checksum"]
    resolved = json.loads((controller_home / "run" / "config.json").read_text())
    assert resolved["data"]["path"] == "corpus"

