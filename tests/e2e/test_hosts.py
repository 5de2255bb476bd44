"""End to end: pods of several hosts under `multipod local --hosts-per-pod 2` (four worker
processes for two pods; the two hosts of a pod form one jax.distributed cluster).

Compared with the same config on single-host pods of two devices running the fused step (the pods
of two hosts overlap the exchange, dcn.overlap = true): the per-step losses agree to float tolerance
(the programs are cut differently, so not bitwise), the pods are bitwise identical at every step in
both layouts, and each host moves half of the pod's gradient over the DCN. The run evaluates
and writes its closing sample as a user's does; its checkpoints restore onto pods of two hosts and
of one, `multipod generate` writes its very sample, `multipod report` draws it, `multipod ptune`
tunes a prompt on it, and a killed host fails its pod, which rejoins as a whole."""
from __future__ import annotations

import concurrent.futures
import json
import math
import re
import shutil

import pytest

from multipod.pod_worker import checkpoint
from tests.e2e import ptune_task
from tests.e2e.pod_failure import held_env, kill_and_finish
from tests.e2e.shared_runs import SharedRun, shared_run
from tests.e2e.test_recovery import _events, _Live, _run
from tests.helpers import TINY, namespace_problem, read_evals, read_metrics, run_cli, run_param_count, same_losses

STEPS = 8
# As a user runs it: evaluation during the run and at its end, and the closing sample (every host
# of a pod runs the generation's programs). The overlapped step, which dcn.overlap = auto leaves to
# steps bigger than the tiny model's, so that pods of several hosts overlap here.
COMMON = ("--config", TINY, "--steps", str(STEPS), "--checkpoint-every", "4", "--eval-every", "4",
          "--set", "dcn.overlap=true", "--set", "dcn.timeout_s=30",
          "--set", "run.step_timeout_s=90", "--set", "health.interval_s=0.5", "--set", "health.timeout_s=3")
TWO_HOSTS = ("--pods", "2", "--hosts-per-pod", "2", "--devices-per-host", "1")
ONE_HOST = ("--pods", "2", "--devices-per-pod", "2")


def two_hosts_reference(tmp_path_factory, env) -> SharedRun:
    """The run of pods of two hosts, once per session: the tests below read, restore, generate
    from and tune on it, and test_netns compares the same run in namespaces with it."""
    return shared_run(tmp_path_factory, "two-hosts", "local", *TWO_HOSTS, *COMMON, env=env)


@pytest.fixture(scope="module")
def two_hosts_run(tmp_path_factory, env) -> SharedRun:
    return two_hosts_reference(tmp_path_factory, env)


@pytest.fixture(scope="module")
def two_hosts(two_hosts_run):
    return two_hosts_run.run_dir


def _identical(records: list[dict]) -> None:
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert len(r["checksums"]) == 2 and len(set(r["checksums"])) == 1, r["step"]
    assert len({r["checksums"][0] for r in records}) == STEPS


def test_two_hosts_per_pod_train_like_one_host_with_both_devices(two_hosts, tmp_path, env):
    # The shared run overlaps the exchange; this reference runs the fused step, so the one
    # comparison also checks the overlapped step on pods of two hosts against it.
    result = _run("local", "--no-report", *ONE_HOST, *COMMON, "--set", "dcn.overlap=false", "--run-dir", str(tmp_path),
                  env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    hosts, single = read_metrics(two_hosts), read_metrics(tmp_path)
    _identical(hosts)
    _identical(single)
    same_losses(hosts, single)
    assert sorted(p.name for p in two_hosts.glob("worker-*.log")) == [
        "worker-0-host-0.log", "worker-0-host-1.log", "worker-1-host-0.log", "worker-1-host-1.log"]


def test_each_host_moves_half_of_the_pod_s_gradient(two_hosts):
    params = run_param_count(two_hosts)
    for r in read_metrics(two_hosts):
        for pod in r["pods"]:
            # 2 pods: each host sends its block (half of every leaf, rounded up) to its peer host.
            assert params * 4 / 2 <= pod["dcn_bytes_sent"] <= params * 4 / 2 + 64, r["step"]


def test_a_checkpoint_of_two_host_pods_restores_bitwise_onto_two_host_pods(two_hosts, tmp_path, env):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(two_hosts / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / str(STEPS))         # as if the run had stopped after step 4's checkpoint
    run_dir = tmp_path / "run"
    result = _run("local", "--no-report", *TWO_HOSTS, *COMMON, "--resume", "--checkpoint-dir", str(checkpoints),
                  "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from" in result.stdout and "step 4" in result.stdout
    resumed, original = read_metrics(run_dir), {r["step"]: r for r in read_metrics(two_hosts)}
    assert [r["step"] for r in resumed] == list(range(4, STEPS))
    for r in resumed:
        assert r["loss"] == original[r["step"]]["loss"] and r["checksums"] == original[r["step"]]["checksums"]


def test_a_checkpoint_of_two_host_pods_restores_onto_single_host_pods_of_two_devices(two_hosts, tmp_path, env):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(two_hosts / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / str(STEPS))
    saved = checkpoint.read_metadata(str(checkpoints / "4"))
    for host in (0, 1):     # each host of the pod wrote its part (orbax keeps one folder per process)
        assert any(f.is_file() for f in (checkpoints / "4" / "state" / f"ocdbt.process_{host}").rglob("*")), host
    run_dir = tmp_path / "run"
    result = _run("local", "--no-report", *ONE_HOST, *COMMON, "--resume", "--checkpoint-dir", str(checkpoints),
                  "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    restored = [e for e in _events(run_dir) if e["event"] == "restored"]
    # Each host wrote its shards; one process of two devices read them back bitwise.
    assert [(e["step"], e["fingerprint"]) for e in restored] == [(4, saved["fingerprint"])]
    resumed, original = read_metrics(run_dir), {r["step"]: r for r in read_metrics(two_hosts)}
    assert [r["step"] for r in resumed] == list(range(4, STEPS))
    for r in resumed:
        assert len(set(r["checksums"])) == 1, r["step"]
        assert r["loss"] == pytest.approx(original[r["step"]]["loss"], rel=1e-5), r["step"]


def _kill_host_1_of_pod_1(run_dir, two_hosts, env, *extra: str) -> None:
    """The shared run's command (and `extra`), host 1 of pod 1 killed once step 2 is recorded; from
    step 5 the controller waits for the failed pod to be ready again (a test hook,
    controller/core/fault_hooks.py), so its return is an event the run waits for, not a race with
    its end. Checks that every step is recorded once with the shared run's checksums."""
    hold = run_dir.parent / f"{run_dir.name}-hold"     # the kill lands before step 3 (a test hook too)
    run = _Live("local", "--no-report", *TWO_HOSTS, *COMMON, *extra, "--run-dir", str(run_dir),
                env=held_env(dict(env, MULTIPOD_TEST_REJOIN_BY_STEP="5"), hold, 3))

    def host_1_of_pod_1() -> int:
        return int(re.findall(r"\(pid (\d+)\)", (run_dir / "worker-1-host-1.log").read_text())[-1])

    code = kill_and_finish(run, run_dir, host_1_of_pod_1, "degraded: 1/2 pods", step=2, hold=hold)
    assert code == 0, "".join(run.out) + "".join(run.err)
    records, expected = read_metrics(run_dir), {r["step"]: r for r in read_metrics(two_hosts)}
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert set(r["checksums"]) == set(expected[r["step"]]["checksums"]), r["step"]
    assert json.loads((run_dir / "summary.json").read_text())["checksum"] == \
        json.loads((two_hosts / "summary.json").read_text())["checksum"]


def test_a_killed_host_fails_its_pod_and_the_run_ends_as_if_uninterrupted(two_hosts, tmp_path, env):
    # The pod's two hosts are restarted and rejoin; the uninterrupted run is the shared one.
    run_dir = tmp_path / "run"
    _kill_host_1_of_pod_1(run_dir, two_hosts, env)
    events = _events(run_dir)
    assert [e["pods"] for e in events if e["event"] == "pod_failure"] == [[1]]
    assert [e["pods"] for e in events if e["event"] == "rejoin"] == [[1]]     # both hosts came back as one pod


def test_a_spare_pod_of_two_hosts_takes_the_slot_of_a_pod_whose_host_died(two_hosts, tmp_path, env):
    # Hot-swap of a whole pod: with --spares 1 the killed host's pod is not restarted; the spare
    # pod (two --spare workers, a jax.distributed cluster of their own) takes slot 1 and receives
    # the state host to host. Its other host, left alone, is stopped.
    # Where namespaces can be made (CI), test_netns runs this very run in them, with every check
    # below, so it runs once; on loopback here only where they cannot be.
    if namespace_problem() is None:
        pytest.skip("run with namespaces by test_netns.py::test_pods_of_two_hosts_in_namespaces_lose_a_pod_and_"
                    "train_bitwise_as_on_loopback, with this test's checks")
    run_dir = tmp_path / "run"
    _kill_host_1_of_pod_1(run_dir, two_hosts, env, "--spares", "1")
    events = _events(run_dir)
    (spare,) = [e["spare"] for e in events if e["event"] == "spare_ready"]
    (swap,) = [e for e in events if e["event"] == "hot_swap"]
    assert swap["slot"] == 1 and swap["new_address"] == spare and len(spare.split(",")) == 2
    for host in (0, 1):
        log = (run_dir / f"spare-0-host-{host}.log").read_text()
        assert f"pod 1 host {host}: a spare takes this slot" in log
        assert len(re.findall(r"serving on", (run_dir / f"worker-1-host-{host}.log").read_text())) == 1


def test_a_host_index_out_of_range_is_refused_naming_the_host():
    result = run_cli("worker", "--pod-index", "1", "--host-index", "2", "--hosts-per-pod", "2",
                     "--pod-coordinator", "127.0.0.1:1", "--insecure-no-auth", timeout=60)
    assert result.returncode != 0
    assert "pod 1 host 2" in result.stderr and "--host-index 2 is out of range" in result.stderr


def test_several_hosts_need_a_coordinator():
    result = run_cli("worker", "--pod-index", "0", "--host-index", "0", "--hosts-per-pod", "2",
                     "--insecure-no-auth", timeout=60)
    assert result.returncode != 0 and "--pod-coordinator must be HOST:PORT" in result.stderr


# The commands around a run, on its pods of two hosts.
def _identical_pods(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert len(r["checksums"]) == 2 and len(set(r["checksums"])) == 1, r["step"]


def test_a_run_of_two_host_pods_evaluates_and_writes_its_closing_sample(two_hosts_run):
    run_dir = two_hosts_run.run_dir
    _identical_pods(read_metrics(run_dir), STEPS)
    evals = read_evals(run_dir)
    assert [e["trained_steps"] for e in evals] == [4, STEPS]
    assert all(math.isfinite(e["eval_loss"]) and e["eval_tokens"] > 0 for e in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert summary["sample"].startswith(config["sample"]["prompt"])
    assert len(summary["sample"]) > len(config["sample"]["prompt"])
    assert "sample:" in two_hosts_run.stdout and (run_dir / "report.png").is_file()


def test_generate_writes_the_run_s_sample_from_its_checkpoint_and_report_draws_the_run(two_hosts_run, tmp_path, env):
    run_dir = two_hosts_run.run_dir
    config = json.loads((run_dir / "config.json").read_text())
    sample = config["sample"]
    # The closing sample's request: its prompt, length, temperature and seed, no end token.
    generate = ("generate", "--checkpoint", str(run_dir), "--prompt", sample["prompt"], "--max-tokens",
                str(sample["tokens"]), "--temperature", str(sample["temperature"]), "--seed",
                str(config["run"]["seed"]), "--ignore-eos", "--shift-context", "--devices", "2")
    report = ("report", str(run_dir), "--out", str(tmp_path / "report.png"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        generated, drawn = pool.map(lambda args: run_cli(*args, env=env), (generate, report))
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert f"(step {STEPS})" in generated.stderr
    # Each host of the pods wrote its part of the checkpoint; one process of two devices reads
    # it, and its generation on the same mesh writes what the pods of two hosts wrote.
    assert generated.stdout.rstrip("\n") == json.loads((run_dir / "summary.json").read_text())["sample"]
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ptune_tunes_a_prompt_on_two_host_pods_as_on_single_host_pods(two_hosts_run, tmp_path, env):
    run_dir = two_hosts_run.run_dir
    _, task = ptune_task.write(tmp_path)
    steps = 4

    def ptune(name: str, pods: tuple[str, ...], *extra: str):
        return run_cli("ptune", "--checkpoint", str(run_dir / "checkpoints"), "--data", str(task), "--kind", "prompt",
                       "--virtual-tokens", "4", *pods, "--steps", str(steps), "--eval-every", "2", "--no-peak",
                       "--run-dir", str(tmp_path / name), *extra, env=env)
    # The reference on pods of one host leaves out what the run on two-host pods checks: the
    # closing sample and report.png.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hosts, single = pool.map(lambda args: ptune(*args), (("hosts", TWO_HOSTS),
                                                              ("single", ONE_HOST, "--no-report", "--set",
                                                               "sample.tokens=0")))
    assert hosts.returncode == 0, hosts.stdout + hosts.stderr
    assert single.returncode == 0, single.stdout + single.stderr
    assert "frozen base" in hosts.stdout and "sample:" in hosts.stdout
    assert (tmp_path / "hosts" / "report.png").is_file()
    records, reference = read_metrics(tmp_path / "hosts"), read_metrics(tmp_path / "single")
    _identical_pods(records, steps)
    for a, b in zip(records, reference):
        # The output tokens the loss counts: summed over the hosts' rows, as one host counts them.
        if not a.get("partial_loss"):
            assert a["tokens"] == b["tokens"], a["step"]
    same_losses(records, reference)
    evals, evals_single = read_evals(tmp_path / "hosts"), read_evals(tmp_path / "single")
    assert [e["trained_steps"] for e in evals] == [2, steps]
    for a, b in zip(evals, evals_single):
        assert a["eval_tokens"] == b["eval_tokens"] and a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    summary = json.loads((tmp_path / "hosts" / "summary.json").read_text())
    assert summary["sample"] and summary["base_fingerprint"]
