"""A process of multipod that crashes in native code (SIGSEGV here, as a bug in XLA, gRPC or
ZeroMQ would raise it) prints every thread's Python stack before it dies (cli.entry enables
faulthandler), on both sides: a worker, into what becomes its log, and a controller."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.helpers import ROOT, TINY, cli_argv, cli_env

DEADLINE_S = 120


def _crash(argv: list[str], ready, tmp_path) -> str:
    """Start argv, wait until ready(stdout lines so far) holds, send it SIGSEGV; its stderr."""
    out = (tmp_path / "stdout").open("w+")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not ready((tmp_path / "stdout").read_text()):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the process never got ready"
            time.sleep(0.1)
        proc.send_signal(signal.SIGSEGV)
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGSEGV, err
    return err


@pytest.mark.parametrize("side", ["worker", "controller"])
def test_a_crash_in_native_code_prints_every_thread_s_stack(side, tmp_path):
    if side == "worker":
        port_file = tmp_path / "port"
        argv = cli_argv("worker", "--pod-index", "0", "--listen", "127.0.0.1:0", "--insecure-no-auth",
                        "--port-file", str(port_file))
        err = _crash(argv, lambda _: port_file.exists(), tmp_path)
        where = "in serve"          # written once serving, from inside serve(), which then waits
    else:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("a few lines of text for a controller that never meets its worker\n" * 200)
        # Port 9 (discard) has no worker: the controller waits for it until Ctrl-C, or here the crash.
        argv = cli_argv("train", "--workers", "127.0.0.1:9", "--config", TINY, "--data", str(corpus),
                        "--checkpoint-dir", str(tmp_path / "checkpoints"), "--run-dir", str(tmp_path / "run"),
                        "--set", f"run.connect_timeout_s={DEADLINE_S}")
        err = _crash(argv, lambda out: "token cache" in out, tmp_path)
        where = "in run_training"   # the token cache is ready inside it, then it connects
    assert "Fatal Python error: Segmentation fault" in err, err
    assert "most recent call first" in err and where in err, err
