"""Shared test helpers: run the CLI in a subprocess, read a run's metrics."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


# The cache root of every test session on this machine, as ~/.cache/multipod is a user's
# (pod_worker/schema/caches.py): the token caches and trained tokenizers of every run a test
# starts, and the compiled programs of every process (tests/conftest.py).
TEST_CACHE_ROOT = pathlib.Path(tempfile.gettempdir()) / f"multipod-test-cache-{os.getuid()}"


def cli_env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["MULTIPOD_PEAK_FILE"] = str(ROOT / ".no-such-peak-file.json")  # MFU stays null unless asked
    # The tests' own cache root, out of the user's own ~/.cache: a corpus is tokenized once, then
    # reused while it and the tokenizer hold.
    env["MULTIPOD_CACHE_DIR"] = str(TEST_CACHE_ROOT)
    return env


# How a test starts the CLI in a process it may interrupt: with Ctrl-C's handler in place. A shell
# that starts the test run in the background ignores SIGINT for it, and an ignored signal stays
# ignored in every child, so `multipod` would train on through the test's Ctrl-C.
_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "runpy.run_module('multipod.cli', run_name='__main__', alter_sys=True)")


def cli_argv(*args: str) -> list[str]:
    """The command line of `multipod ARGS` in a fresh process that Ctrl-C (SIGINT) interrupts."""
    return [sys.executable, "-c", _WITH_CTRL_C, *args]


def run_cli(*args: str, timeout: float = 240, cwd: pathlib.Path | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`multipod ARGS` in a fresh process (the same code as the console script), in cli_env()
    updated with `env`."""
    return subprocess.run([sys.executable, "-m", "multipod.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**cli_env(), **(env or {})}, cwd=cwd or ROOT, stdin=subprocess.DEVNULL)


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    """The step records of metrics.jsonl, in file order (evaluation records left out)."""
    return [r for r in _records(run_dir) if "loss" in r]


def run_param_count(run_dir: pathlib.Path) -> int:
    """The parameter count of the model a run trained, from its resolved config.json (whose
    vocab_size followed the tokenizer)."""
    from multipod.model import ModelConfig
    return ModelConfig(**json.loads((run_dir / "config.json").read_text())["model"]).param_count()


def same_losses(records: list[dict], reference: list[dict], rel: float = 1e-5) -> None:
    """Assert that two runs' step losses agree (to `rel`) at every step both report whole. A step
    recorded with partial_loss (a pod failed during it: a loaded machine can miss a health check,
    and degraded mode carries on bitwise) holds the loss of the shards that came back only, so it
    is left out; its state is checked like any other by the run itself (checksums)."""
    whole = {r["step"]: r for r in reference if not r.get("partial_loss")}
    compared = [r for r in records if not r.get("partial_loss") and r["step"] in whole]
    assert compared, "no step to compare"
    for r in compared:
        assert r["loss"] == pytest.approx(whole[r["step"]]["loss"], rel=rel), r["step"]


def read_evals(run_dir: pathlib.Path) -> list[dict]:
    """The evaluation records of metrics.jsonl, in file order."""
    return [r for r in _records(run_dir) if "eval_loss" in r]


def jsonl(path: pathlib.Path) -> list[dict]:
    """The records of a .jsonl file a run may still be writing: a last line without its newline
    is a record being written, left out (a finished file ends with one)."""
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _records(run_dir: pathlib.Path) -> list[dict]:
    return jsonl(run_dir / "metrics.jsonl")


def worker_pids(run_dir: pathlib.Path) -> list[int]:
    """The pids the local workers logged when they started serving."""
    pids = []
    for log in sorted(run_dir.glob("worker-*.log")):
        match = re.search(r"\(pid (\d+)\)", log.read_text())
        assert match, f"no pid in {log}"
        pids.append(int(match.group(1)))
    return pids


def pid_alive(pid: int) -> bool:
    """Whether a process (not a zombie, not another process's thread) has the number `pid`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same. So does a thread id (a dead
    # worker's number reused for a thread elsewhere): its Tgid is its process's number.
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return fields.get("Tgid", "").strip() == str(pid) and not fields.get("State", "").strip().startswith("Z")


def hold_process(pid: int) -> int | None:
    """A pidfd on the live process `pid`, or None if it is gone. A signal sent through it
    (kill_held) reaches that process or none: never a later process, or a thread of the test
    process itself, given the same number once it has exited (kill(2) on a thread id signals its
    whole process)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def kill_held(pidfd: int | None) -> None:
    """SIGKILL the process hold_process returned `pidfd` for, if it still runs; closes the fd."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def tiny_worker_config():
    """The worker's part of configs/tiny.toml, built without the controller (tests/unit/controller
    checks that it equals the controller's projection of that file)."""
    from multipod.model import ModelConfig
    from multipod.pod_worker.schema import OptimizerConfig, TrainShape, WorkerConfig
    return WorkerConfig(
        model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8, mlp_dim=64, max_seq_len=32),
        optimizer=OptimizerConfig(learning_rate=3e-2, warmup_steps=2),
        train=TrainShape(seed=0, total_steps=20, seq_len=32, global_batch=8)).validate()


def train_identical_pods(run_dir: pathlib.Path, pods: int, steps: int, *args: str, settings=()) -> list[dict]:
    """`multipod local` on configs/tiny.toml with `pods` one-device pods for `steps` steps (extra CLI
    args, and `--set` for each of settings); asserts it succeeded, that the pods were bitwise
    identical at every step and that the state changed every step; returns the step records."""
    cli = ["local", "--pods", str(pods), "--devices-per-pod", "1", "--config", TINY, "--steps", str(steps),
           "--run-dir", str(run_dir), "--no-report", "--set", "sample.tokens=0", "--set", "eval.batches=0", *args]
    for setting in settings:
        cli += ["--set", setting]
    result = run_cli(*cli)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert len(r["checksums"]) == pods and len(set(r["checksums"])) == 1, f"pods differ at step {r['step']}"
    assert len({r["checksums"][0] for r in records}) == steps   # the state does change
    return records


def namespace_problem(pods: int = 1) -> str | None:
    """Why this machine cannot make network namespaces for `pods` pods, or None where it can (CI
    runs as root and makes them); checks that the probe's network is gone again."""
    from multipod.controller.launch.netns import NetnsError, Network, wait_gone
    probe = Network(pods, 1)
    try:
        probe.create()
    except NetnsError as exc:
        return str(exc)
    finally:
        probe.destroy()
    assert not wait_gone(probe.run_id)
    return None


def require_namespaces(pods: int = 1) -> None:
    """Skip the calling test, saying why, where this machine cannot make network namespaces."""
    problem = namespace_problem(pods)
    if problem is not None:
        pytest.skip(f"network namespaces cannot be made here: {problem}")

