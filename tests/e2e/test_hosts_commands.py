"""End to end: the commands around a training run, on pods of two hosts (`--hosts-per-pod 2`: four
worker processes for two pods), with the closing sample on.

One `multipod local` run of pods of two hosts evaluates the held-out split during the run and at
its end, and writes its closing sample (every host of a pod runs the generation's programs);
`multipod generate` on its checkpoint (one single-host pod of the same mesh) writes that very
sample, `multipod report` draws its run directory, and `multipod ptune` tunes a prompt on its
checkpoint on pods of two hosts as on single-host pods of two devices, with its own closing sample."""
from __future__ import annotations

import concurrent.futures
import json
import math

import pytest

from tests.e2e import ptune_task
from tests.helpers import TINY, read_evals, read_metrics, run_cli, same_losses

STEPS = 6
TWO_HOSTS = ("--pods", "2", "--hosts-per-pod", "2", "--devices-per-host", "1")
# The same mesh (data=2, model=1) in one process per pod.
ONE_HOST = ("--pods", "2", "--devices-per-pod", "2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("two-host-run")
    result = run_cli("local", *TWO_HOSTS, "--config", TINY, "--steps", str(STEPS), "--eval-every", "3", "--no-peak",
                     "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result


def _identical_pods(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert len(r["checksums"]) == 2 and len(set(r["checksums"])) == 1, r["step"]


def test_a_run_of_two_host_pods_evaluates_and_writes_its_closing_sample(trained):
    run_dir, result = trained
    _identical_pods(read_metrics(run_dir), STEPS)
    evals = read_evals(run_dir)
    assert [e["trained_steps"] for e in evals] == [3, STEPS]
    assert all(math.isfinite(e["eval_loss"]) and e["eval_tokens"] > 0 for e in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert summary["sample"].startswith(config["sample"]["prompt"])
    assert len(summary["sample"]) > len(config["sample"]["prompt"])
    assert "sample:" in result.stdout and (run_dir / "report.png").is_file()


def test_generate_writes_the_run_s_sample_from_its_checkpoint_and_report_draws_the_run(trained, tmp_path, env):
    run_dir, _ = trained
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


def test_ptune_tunes_a_prompt_on_two_host_pods_as_on_single_host_pods(trained, tmp_path, env):
    run_dir, _ = trained
    _, task = ptune_task.write(tmp_path)
    steps = 4

    def ptune(name: str, pods: tuple[str, ...]):
        return run_cli("ptune", "--checkpoint", str(run_dir / "checkpoints"), "--data", str(task), "--kind", "prompt",
                       "--virtual-tokens", "4", *pods, "--steps", str(steps), "--eval-every", "2", "--no-peak",
                       "--run-dir", str(tmp_path / name), env=env)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hosts, single = pool.map(lambda args: ptune(*args), (("hosts", TWO_HOSTS), ("single", ONE_HOST)))
    assert hosts.returncode == 0, hosts.stdout + hosts.stderr
    assert single.returncode == 0, single.stdout + single.stderr
    assert "frozen base" in hosts.stdout and "sample:" in hosts.stdout
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
