"""End to end under `multipod local`: runs that survive.

One uninterrupted reference run (with a NaN gradient injected at step 2 and a loss spike at
step 7, both test-only hooks on pod 0) is compared with
  * a run whose pod 1 is killed with SIGKILL mid-run (the supervisor restarts it, the controller
    restores every pod to the last checkpoint), then hung with SIGSTOP (the controller names it
    and has the supervisor replace it): same final state checksum;
  * a run resumed from the reference run's checkpoints: same per-step losses, same checksum.
A last run, `multipod train` against workers the test owns, has pod 1 stopped with SIGSTOP: the
controller must name it within the health deadline, recover once the test (the user's
supervisor) restarts it, and stop cleanly when a second failure exceeds --max-restarts.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from multipod.controller.launch.local import LocalPods
from multipod.pod_worker import checkpoint
from multipod.protos.channels import Security
from tests.helpers import ROOT, TINY, cli_argv, jsonl, pid_alive, read_metrics

STEPS = 10
COMMON = ("--pods", "2", "--devices-per-pod", "1", "--config", TINY, "--steps", str(STEPS), "--no-report",
          "--checkpoint-every", "3", "--on-spike", "rewind", "--skip-batches", "2",
          "--set", "sample.tokens=0", "--set", "eval.batches=0", "--set", "checkpoint.keep=3",
          "--set", "spike.window=3", "--set", "dcn.timeout_s=10", "--set", "run.step_timeout_s=60",
          "--set", "health.interval_s=1", "--set", "health.timeout_s=5",
          # These tests are about checkpoint rollback; degraded mode has tests/e2e/test_failover.py.
          "--set", 'recovery.on_pod_failure="restore"')


@pytest.fixture(scope="module")
def env(cached_env):
    """The CLI's environment with the session's compilation cache (conftest.py) and the test
    hooks (pod_worker/faults.py, controller/core/fault_hooks.py): pod 0's gradient is NaN at step 2, and
    the step that trains on batch 7 records a loss spike."""
    return dict(cached_env, MULTIPOD_TEST_NAN_GRADIENT="0:2", MULTIPOD_TEST_SPIKE_BATCH="7")


def _run(*args: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multipod.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


def _final(run_dir: pathlib.Path) -> dict[int, dict]:
    """The last record of every step (a step replayed after a recovery appears twice)."""
    return {r["step"]: r for r in read_metrics(run_dir)}


def _events(run_dir: pathlib.Path) -> list[dict]:
    return jsonl(run_dir / "events.jsonl")


def _wait_for_step(proc: subprocess.Popen, run_dir: pathlib.Path, step: int, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(r["step"] >= step for r in read_metrics(run_dir) if r):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def _current_pid(run_dir: pathlib.Path, pod: int) -> tuple[int, int]:
    """(pid, port) of the latest incarnation of a local worker, from its log."""
    found = re.findall(r"serving on [\d.]+:(\d+) \(pid (\d+)\)", (run_dir / f"worker-{pod}.log").read_text())
    assert found, f"pod {pod} never served"
    return int(found[-1][1]), int(found[-1][0])


class _Live:
    """A CLI process whose stdout/stderr lines are collected as they come."""

    def __init__(self, *args: str, env: dict):
        self.proc = subprocess.Popen(cli_argv(*args), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
        self.out: list[str] = []
        self.err: list[str] = []
        self._seen = 0
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, lines):
        for line in stream:
            lines.append(line)

    def wait_for(self, text: str, timeout: float) -> str:
        """The next stdout line (after the ones earlier waits returned) that contains text."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = self.proc.poll() is not None
            if ended:       # what it printed last may still be in the pumps: let them drain first
                for t in self._threads:
                    t.join(timeout=10)
            for index in range(self._seen, len(self.out)):
                if text in self.out[index]:
                    self._seen = index + 1
                    return self.out[index]
            assert not ended, f"the run ended without printing {text!r}:\n" + "".join(self.out + self.err)
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not printed within {timeout}s:\n" + "".join(self.out + self.err))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # What the run last said shows where it was stuck (a hang is a bug to find).
            tail = "".join(self.out[-40:]) + "".join(self.err[-40:])
            raise AssertionError(f"the run did not end within {timeout:g}s; its last output:\n{tail}") from None
        for t in self._threads:
            t.join(timeout=10)
        return code


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> tuple[str, ...]:
    """COMMON, reading a copy of the project's docs through a BPE of 512 tokens trained on them
    (once, then cached): resuming is checked on a trained tokenizer and the epoch-permuted token
    pipeline. A copy, so that the corpus (and with it the tokenizer and the batches) cannot change
    between the runs compared."""
    corpus = tmp_path_factory.mktemp("corpus")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        shutil.copyfile(doc, corpus / doc.name)
    return (*COMMON, "--data", str(corpus), "--tokenizer", "bpe:512")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env, common):
    run_dir = tmp_path_factory.mktemp("reference")
    result = _run("local", *common, "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def test_a_run_on_a_trained_bpe_trains(reference):
    config = json.loads((reference / "config.json").read_text())
    assert config["data"]["tokenizer"] == "bpe:512" and config["model"]["vocab_size"] == 512
    records = _final(reference)
    # The loss falls from about ln(512) = 6.2, in 10 steps of which one is skipped and one rewound
    # (6.25 -> 5.90 when measured).
    assert records[STEPS - 1]["loss"] < records[0]["loss"] - 0.2, (records[0]["loss"], records[STEPS - 1]["loss"])


def test_nan_gradient_step_is_skipped_the_same_way_on_every_pod(reference):
    records = _final(reference)
    assert records[2]["skipped"] and not any(records[s]["skipped"] for s in records if s != 2)
    # Both pods skipped the update: identical checksums, and the state did not change.
    assert len(set(records[2]["checksums"])) == 1
    assert records[2]["checksums"] == records[1]["checksums"]
    assert records[3]["checksums"] != records[2]["checksums"]
    assert records[STEPS - 1]["skipped_steps"] == 1
    assert json.loads((reference / "summary.json").read_text())["skipped_steps"] == 1


def test_loss_spike_rewinds_to_the_checkpoint_before_it_and_skips_batches(reference):
    rewinds = [e for e in _events(reference) if e["event"] == "rewind"]
    assert len(rewinds) == 1
    assert rewinds[0]["spike_step"] == 7 and rewinds[0]["to_step"] == 6 and rewinds[0]["data_offset"] == 2
    records = _final(reference)
    assert sorted(records) == list(range(STEPS))
    # After the rewind, step s trains on batch s + 2; before it, on batch s.
    assert [records[s]["data_index"] for s in range(STEPS)] == list(range(6)) + [s + 2 for s in range(6, STEPS)]
    assert max(r["loss"] for r in records.values()) < 10      # the spiked loss was replaced
    for r in records.values():
        assert len(set(r["checksums"])) == 1


def test_checkpoints_are_written_and_only_the_last_k_kept(reference):
    saved = [e["step"] for e in _events(reference) if e["event"] == "checkpoint_saved"]
    assert saved == [0, 3, 6, 9, 10]
    assert sorted(int(p.name) for p in (reference / "checkpoints").iterdir() if p.name.isdigit()) == [6, 9, 10]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["last_checkpoint"] == str(reference / "checkpoints" / "10")


def test_killed_and_hung_workers_are_restarted_and_the_run_ends_as_if_uninterrupted(reference, tmp_path, env,
                                                                                   common):
    """kill -9 pod 1 mid-run; once the run has recovered, stop the new pod 1 with SIGSTOP: the
    controller names it, has the supervisor replace it, and recovers again. The run ends with
    the uninterrupted run's state checksum. The controller holds (a test hook) before step 4, for
    the kill, and before step 5, first reached after the recovery (from the checkpoint of step 3),
    for the stop: neither can land after the run has ended."""
    from tests.e2e.pod_failure import held_env, release, wait_held  # here: pod_failure imports this module
    hold = tmp_path / "hold"
    run = _Live("local", *common, "--run-dir", str(tmp_path), env=held_env(env, hold, 4, 5))
    try:
        wait_held(run, hold, 4)
        pid, port = _current_pid(tmp_path, 1)
        os.kill(pid, signal.SIGKILL)
        release(hold, 4)
        run.wait_for("recovered", 300)
        wait_held(run, hold, 5)
        hung, hung_port = _current_pid(tmp_path, 1)
        assert hung != pid and hung_port == port          # restarted on the same port
        os.kill(hung, signal.SIGSTOP)
        release(hold, 5)
        line = run.wait_for("is not responding", 100)
        assert f"pod 1 (127.0.0.1:{port}) is not responding" in line
        code = run.finish(400)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    stdout, stderr = "".join(run.out), "".join(run.err)
    assert code == 0, stdout + stderr
    last, last_port = _current_pid(tmp_path, 1)
    assert last not in (pid, hung) and last_port == port and not pid_alive(hung)
    failures = [e for e in _events(tmp_path) if e["event"] == "pod_failure"]
    assert len(failures) == 2 and all("pod 1" in f["error"] for f in failures)
    assert "not responding" in failures[1]["error"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts"] == 2
    expected = json.loads((reference / "summary.json").read_text())["checksum"]
    assert summary["checksum"] == expected
    assert _final(tmp_path)[STEPS - 1]["loss"] == _final(reference)[STEPS - 1]["loss"]


def test_resumed_run_equals_the_uninterrupted_run(reference, tmp_path, env, common):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / "10")          # as if the run had stopped after step 9's checkpoint
    run_dir = tmp_path / "run"
    result = _run("local", *common, "--resume", "--checkpoint-dir", str(checkpoints), "--run-dir", str(run_dir),
                  env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from" in result.stdout and "step 9" in result.stdout
    for pod in (0, 1):      # each took its state from the checkpoint, with no initial state built to replace
        assert "configured no initial state (its first Restore gives it one)" in \
            (run_dir / f"worker-{pod}.log").read_text()
    resumed, original = _final(run_dir), _final(reference)
    assert sorted(resumed) == [9]
    for step, record in resumed.items():     # bitwise: exact float equality
        assert record["loss"] == original[step]["loss"]
        assert record["checksums"] == original[step]["checksums"]
        assert record["data_index"] == original[step]["data_index"]
    assert json.loads((run_dir / "summary.json").read_text())["checksum"] == \
        json.loads((reference / "summary.json").read_text())["checksum"]


def test_train_against_remote_workers_survives_a_hang_and_stops_beyond_max_restarts(tmp_path, env, monkeypatch):
    """`multipod train` with workers it does not own (the test plays the user's supervisor):
    a hung worker is named within the health deadline; once the user restarts it, the run
    recovers; a failure beyond --max-restarts stops the run with the last good checkpoint intact."""
    token = "token-for-the-remote-test-0123456789"
    run_dir, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", env["JAX_COMPILATION_CACHE_DIR"])   # for LocalPods
    with LocalPods(2, 1, tmp_path / "workers", security=Security(token=token)) as pods:
        env = dict(env, MULTIPOD_AUTH_TOKEN=token)
        run = _Live("train", "--workers", ",".join(pods.addresses), "--config", TINY, "--steps", "60",
                    "--checkpoint-every", "3", "--max-restarts", "1", "--run-dir", str(run_dir),
                    "--checkpoint-dir", str(checkpoints),
                    "--set", "sample.tokens=0", "--set", "eval.batches=0",
                    "--set", "health.interval_s=0.5", "--set", "health.timeout_s=2",
                    "--set", "run.step_timeout_s=120", "--set", "dcn.timeout_s=120",
                    "--set", "recovery.restart_timeout_s=300", "--set", 'recovery.on_pod_failure="restore"', env=env)
        hung = None
        try:
            _wait_for_step(run.proc, run_dir, 4)
            hung = pods.procs[1]        # its Popen: a signal after it has been reaped goes nowhere
            hung.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            line = run.wait_for("is not responding", 100)
            named_after = time.monotonic() - stopped
            assert f"pod 1 ({pods.addresses[1]}) is not responding" in line
            # Far sooner than the 120 s step and DCN deadlines: two missed 2 s health checks.
            assert named_after < 60, named_after
            pods.restart(1)                     # the user's supervisor replaces the hung worker
            run.wait_for("recovered", 300)
            os.kill(pods.procs[1].pid, signal.SIGKILL)   # a second failure: beyond --max-restarts 1
            code = run.finish(300)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
            if hung is not None:
                hung.kill()
    stderr = "".join(run.err)
    assert code == 1, "".join(run.out) + stderr
    assert "pod 1" in stderr and "Giving up after 1 restart(s) (--max-restarts 1)" in stderr
    last = re.search(r"the last good checkpoint is (\S+) \(step (\d+)\)", stderr)
    assert last, stderr
    path, step = pathlib.Path(last.group(1)), int(last.group(2))
    assert path == checkpoints / str(step) and step > 0
    assert step in checkpoint.steps(str(checkpoints))     # intact, ready for --resume
    assert checkpoint.read_metadata(str(path))["step"] == step


def test_failed_checkpoints_are_reported_at_once_and_the_run_goes_on(tmp_path, env, monkeypatch):
    # Pods the user runs, saving to shared storage the controller does not make (multipod local
    # refuses an unusable checkpoint folder before it starts): every save fails on the pods.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory's parent should be\n")
    run_dir = tmp_path / "run"
    token = "token-for-the-failed-saves-test-0123"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", env["JAX_COMPILATION_CACHE_DIR"])   # for LocalPods
    with LocalPods(2, 1, tmp_path / "workers", security=Security(token=token)) as pods:
        result = _run("train", "--workers", ",".join(pods.addresses), "--config", TINY, "--steps", "4",
                      "--checkpoint-every", "2", "--checkpoint-dir", str(blocker / "checkpoints"),
                      "--set", "sample.tokens=0", "--set", "eval.batches=0", "--run-dir", str(run_dir),
                      env=dict(env, MULTIPOD_AUTH_TOKEN=token))
    assert result.returncode == 0, result.stdout + result.stderr
    for step in (0, 2, 4):
        assert f"ERROR: checkpoint of step {step} FAILED" in result.stdout, result.stdout
    assert "The last good checkpoint is still none yet" in result.stdout
    failed = [e["step"] for e in _events(run_dir) if e["event"] == "checkpoint_failed"]
    assert failed == [0, 2, 4]
    # Reported as soon as it is known: step 0's failure comes before the last step's record.
    lines = result.stdout.splitlines()
    assert min(i for i, l in enumerate(lines) if "checkpoint of step 0 FAILED" in l) < \
        max(i for i, l in enumerate(lines) if l.startswith("step "))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failed_checkpoints"] == 3 and summary["last_checkpoint"] is None
    assert summary["steps"] == 4
