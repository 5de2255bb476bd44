"""End to end: `multipod local` with simulated pods, tiny model.

One 2-pod run and one 1-pod run (same seed, evaluating every EVAL_EVERY steps) are shared by the
tests below.
"""
import json
import shutil

import pytest

from tests.helpers import TINY, pid_alive, read_evals, read_metrics, run_cli, same_losses, worker_pids

STEPS = 20
EVAL_EVERY = 10


def _local_run(tmp_path_factory, pods: int, *extra: str, env: dict | None = None):
    """`multipod local` with `pods` pods of 2 devices each, same seed and steps for every run."""
    run_dir = tmp_path_factory.mktemp(f"pods{pods}")
    result = run_cli("local", "--pods", str(pods), "--devices-per-pod", "2", "--config", TINY,
                     "--steps", str(STEPS), "--seed", "5", "--run-dir", str(run_dir), "--eval-every", str(EVAL_EVERY),
                     *extra, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result


@pytest.fixture(scope="module")
def two_pods(tmp_path_factory):
    """As a user runs it: the closing sample, report.png, no peak measured (none cached)."""
    return _local_run(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def one_pod(tmp_path_factory):
    """The one-pod reference: it also measures this machine's peak (none cached in its own file),
    and leaves out the closing sample and report.png, which the two-pod run checks."""
    peak_file = tmp_path_factory.mktemp("peak") / "peak.json"
    run_dir, result = _local_run(tmp_path_factory, 1, "--no-report", "--set", "sample.tokens=0",
                                 "--set", "run.measure_peak=true", env={"MULTIPOD_PEAK_FILE": str(peak_file)})
    return run_dir, result, peak_file


def test_two_pods_train_with_identical_parameters(two_pods):
    run_dir, result = two_pods
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert len(r["checksums"]) == 2
        assert r["checksums"][0] == r["checksums"][1], f"pods differ at step {r['step']}"
    # The loss falls: the last steps are clearly below the first.
    first = sum(r["loss"] for r in records[:2]) / 2
    last = sum(r["loss"] for r in records[-2:]) / 2
    assert last < first - 0.3, (first, last)
    # The state changes every step (a checksum that never changes would prove nothing).
    assert len({r["checksums"][0] for r in records}) == STEPS


def test_metrics_and_run_directory(two_pods):
    run_dir, result = two_pods
    record = read_metrics(run_dir)[-1]
    for key in ("step", "loss", "checksums", "step_time_s", "compute_time_s", "exchange_time_s",
                "dcn_bytes_sent", "tokens_per_s", "model_flops_per_token", "mfu"):
        assert key in record, key
    assert record["mfu"] is None  # no peak given and none measured in this fresh HOME
    assert record["dcn_bytes_sent"] > 0 and record["tokens_per_s"] > 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["run"]["steps"] == STEPS and config["model"]["d_model"] == 32
    assert (run_dir / "worker-0.log").exists() and (run_dir / "worker-1.log").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checksum"] == read_metrics(run_dir)[-1]["checksums"][0]
    # Each pod's median wait on a slower pod, from its step records' peer_wait_s.
    waits = summary["median_peer_wait_s"]
    assert sorted(waits) == ["0", "1"] and all(0.0 <= w < 10.0 for w in waits.values())
    # Each pod's waits split into the two kinds the worker measures, never more than it idled.
    for pod in (p for r in read_metrics(run_dir) for p in r["pods"]):
        assert pod["peer_wait_s"] >= 0.0 and pod["wire_wait_s"] >= 0.0, pod
        assert pod["peer_wait_s"] <= pod["idle_s"] + 1e-9 and pod["wire_wait_s"] <= pod["idle_s"] + 1e-9, pod
    assert "sample:" in result.stdout and "done: 20 steps" in result.stdout
    # The run ends with its report (controller/observe/report.py; its unit test checks the panels).
    assert f"report: {run_dir / 'report.png'}" in result.stdout
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workers_are_gone_after_the_run(two_pods):
    run_dir, _ = two_pods
    pids = worker_pids(run_dir)
    assert len(pids) == 2
    assert not any(pid_alive(p) for p in pids)


def test_two_pods_match_one_pod_with_the_whole_batch(two_pods, one_pod):
    two = read_metrics(two_pods[0])
    one = read_metrics(one_pod[0])
    assert len(one) == len(two) == STEPS
    same_losses(two, one)
    assert one[0]["dcn_bytes_sent"] == 0


def test_eval_every_n_steps_is_in_the_metrics_and_two_pods_match_one_pod(two_pods, one_pod):
    two, one = read_evals(two_pods[0]), read_evals(one_pod[0])
    assert [r["trained_steps"] for r in two] == [r["trained_steps"] for r in one] == [10, 20]
    for a, b in zip(two, one):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
        assert a["eval_perplexity"] > 1 and a["eval_bits_per_byte"] > 0 and a["epoch"] > 0
    assert two[-1]["eval_loss"] < two[0]["eval_loss"] + 0.5     # a real loss, in the training loss's range
    assert abs(two[-1]["eval_loss"] - read_metrics(two_pods[0])[-1]["loss"]) < 1.5
    # The step records count epochs too, and the summary reports the last evaluation.
    assert all(r["epoch"] > 0 for r in read_metrics(two_pods[0]))
    summary = json.loads((two_pods[0] / "summary.json").read_text())
    assert summary["eval_loss"] == two[-1]["eval_loss"] and summary["eval_bits_per_byte"] > 0
    # ... and TensorBoard has the eval curve (the tag is in the event file's bytes).
    events = b"".join(p.read_bytes() for p in (two_pods[0] / "tensorboard").rglob("events.out.tfevents.*"))
    assert b"eval_loss" in events and b"eval_bits_per_byte" in events


def test_the_first_local_run_measures_the_peak_and_reports_mfu_and_hfu(one_pod):
    """No --peak-flops and nothing cached: the run measures this machine's peak once, caches it,
    and every record's MFU is the model FLOP/s over that peak (the --peak-flops path is the same
    formula with the given number)."""
    run_dir, result, cache = one_pod
    assert "measuring this machine's peak FLOP/s" in result.stdout and "HFU" in result.stdout
    peak = json.loads(cache.read_text())["cpu/2"]["per_device_flops"]     # 1 pod x 2 devices
    assert peak > 0
    for r in read_metrics(run_dir):
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["model_flops_per_token"] / (peak * 2))
        assert r["hfu"] > 0


def test_no_report_leaves_report_png_out(one_pod):
    run_dir, result, _ = one_pod
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "report.png").exists()
    assert "report:" not in result.stdout


def test_a_finished_run_trains_on_past_its_end_bitwise_with_its_schedule_kept(two_pods, tmp_path):
    """The 2-pod run ended after STEPS steps, its learning rate decayed over them. Resumed to
    STEPS + 4 with that schedule kept (optimizer.decay_steps = STEPS), it trains on at the final
    rate, bitwise the run of STEPS + 4 steps with the same setting; with the schedule changed,
    the refusal says how to keep it."""
    run_dir, _ = two_pods
    checkpoints, more = tmp_path / "checkpoints", str(STEPS + 4)
    shutil.copytree(run_dir / "checkpoints", checkpoints)      # the shared run's own stay as they are
    common = ("local", "--pods", "2", "--devices-per-pod", "2", "--config", TINY, "--steps", more, "--seed", "5",
              "--eval-every", str(EVAL_EVERY), "--no-report", "--set", "sample.tokens=0")
    kept = ("--set", f"optimizer.decay_steps={STEPS}")
    beside = (checkpoints / "run_config.json").read_bytes()
    changed = run_cli(*common, "--resume", "--checkpoint-dir", str(checkpoints), "--run-dir", str(tmp_path / "changed"))
    assert changed.returncode != 0
    assert f"schedule_steps: checkpoint has {STEPS}, this run has {more}" in changed.stderr
    assert f"--set optimizer.decay_steps={STEPS}" in changed.stderr
    # The refused run left the config beside the checkpoints as it was (generate and ptune read
    # the checkpoints with it), and wrote none of its own.
    assert (checkpoints / "run_config.json").read_bytes() == beside
    assert not (tmp_path / "changed" / "config.json").exists()
    resumed = run_cli(*common, *kept, "--resume", "--checkpoint-dir", str(checkpoints),
                      "--run-dir", str(tmp_path / "on"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(step {STEPS}," in resumed.stdout
    assert json.loads((checkpoints / "run_config.json").read_text())["optimizer"]["decay_steps"] == STEPS
    whole = run_cli(*common, *kept, "--run-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    on, reference = read_metrics(tmp_path / "on"), read_metrics(tmp_path / "whole")
    assert [r["step"] for r in on] == list(range(STEPS, STEPS + 4))
    assert [(r["loss"], r["checksums"], r["learning_rate"]) for r in on] == \
        [(r["loss"], r["checksums"], r["learning_rate"]) for r in reference[STEPS:]]
    assert len({r["learning_rate"] for r in on}) == 1     # the final rate, held


def test_a_wsd_run_resumed_from_its_stable_phase_trains_bitwise_as_the_longer_run(tmp_path):
    """optimizer.schedule = "wsd" (warmup-stable-decay), as a user extends a run: a 6-step run (its
    decay starts at step 5) saved step 4, in its stable phase, and step 6. Resumed as a run of 10
    steps (decay from step 8), the newest checkpoint, inside the decay, is refused naming why;
    step 4's resumes, and steps 4-9 are bitwise those of the 10-step run from its start, learning
    rates included: the peak held until the decay, which steps 8 and 9 are the first of."""
    common = ("local", "--pods", "1", "--devices-per-pod", "1", "--config", TINY, "--seed", "5", "--no-report",
              "--set", "sample.tokens=0", "--set", "eval.batches=0", "--set", "optimizer.schedule=wsd")
    short = run_cli(*common, "--steps", "6", "--checkpoint-every", "4", "--run-dir", str(tmp_path / "short"))
    assert short.returncode == 0, short.stdout + short.stderr
    longer = ("--steps", "10", "--resume", "--checkpoint-dir", str(tmp_path / "short" / "checkpoints"))
    refused = run_cli(*common, *longer, "--run-dir", str(tmp_path / "refused"))
    assert refused.returncode != 0
    assert "step 6 is past the start of its own wsd decay (step 5)" in refused.stderr, refused.stderr[-2000:]
    shutil.rmtree(tmp_path / "short" / "checkpoints" / "6")
    resumed = run_cli(*common, *longer, "--run-dir", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "(step 4," in resumed.stdout
    whole = run_cli(*common, "--steps", "10", "--run-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    on, reference = read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "whole")
    assert [r["step"] for r in on] == list(range(4, 10))
    assert [(r["loss"], r["checksums"], r["learning_rate"]) for r in on] == \
        [(r["loss"], r["checksums"], r["learning_rate"]) for r in reference[4:]]
    rates = [r["learning_rate"] for r in reference]
    assert len(set(rates[2:8])) == 1 and rates[9] < rates[7]      # (step 8's is the peak, to float rounding)
    assert [r["learning_rate"] for r in read_metrics(tmp_path / "short")][:5] == rates[:5]
