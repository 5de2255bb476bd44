"""DiLoCo through the CLI (issue 22): `multipod local` with sync.mode = "diloco" on 2 pods, a run
stopped with an outer sync pending and resumed, against the uninterrupted run: every pod's own
final checkpoint (its inner state and the outer state) is bitwise the uninterrupted run's, and
metrics.jsonl records the outer steps at their places in the schedule with the data plane's bytes
at those steps only. DiLoCo on 2 pods of 2 hosts is bitwise DiLoCo on 2 pods of one host with 2
devices; a dead pod is dropped from the outer steps or replayed bitwise, and the checkpoints
taken while it is out resume bitwise. A DiLoCo run warm-starts from an every-step run's checkpoint."""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import shutil

import pytest

from multipod.pod_worker import checkpoint
from tests.e2e.pod_failure import kill_and_finish
from tests.e2e.test_hosts import TWO_HOSTS, two_hosts_reference
from tests.e2e.test_recovery import _current_pid, _events, _Live
from tests.helpers import TINY, read_evals, read_metrics, run_cli

# H = 4, two fragments: an outer sync starts every 2 inner steps; tau = 1, so each applies one
# step later. Checkpoints every 3 steps: step 6's holds a pending sync (started after 6 steps). The
# learning rate decays over 10 steps whatever the run's length, so a longer run's first steps are a
# shorter one's.
SYNC = ["sync.mode=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.overlap_steps=1",
        "sync.outer_dtype=int4", "checkpoint.every=3", "optimizer.decay_steps=10", "eval.batches=0",
        "sample.tokens=0"]
# The 2-pod runs of the resume and restore tests below, whose uninterrupted run of STEPS is the
# reference of both: long enough that the restore test's kill at step 7 lands mid-run on a fast
# machine. (The restore policy and the health checks change nothing in a run no pod fails in.)
STEPS = 40
TWO_POD_SETS = [*SYNC, "recovery.on_pod_failure=restore", "dcn.timeout_s=30", "run.step_timeout_s=90",
                "health.interval_s=0.5", "health.timeout_s=2"]


def _two_pods(steps: int) -> tuple[str, ...]:
    """`multipod local` of the 2-pod DiLoCo runs, for `steps` steps (add --run-dir)."""
    sets = [arg for setting in TWO_POD_SETS for arg in ("--set", setting)]
    return ("local", "--pods", "2", "--devices-per-pod", "1", "--config", TINY, "--steps", str(steps), "--no-report",
            *sets)


def _train(run_dir: pathlib.Path, steps: int, *extra: str) -> None:
    done = run_cli(*_two_pods(steps), "--run-dir", str(run_dir), *extra)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def two_pod_reference(tmp_path_factory) -> pathlib.Path:
    """The uninterrupted 2-pod run of STEPS, for the resume and restore tests to compare with."""
    reference = tmp_path_factory.mktemp("diloco-two-pods") / "reference"
    _train(reference, STEPS)
    return reference


def _final_fingerprints(run_dir: pathlib.Path, steps: int = STEPS) -> list[str]:
    return [checkpoint.read_metadata(str(run_dir / "checkpoints" / f"pod-{pod}" / str(steps)))["fingerprint"]
            for pod in (0, 1)]


def test_a_diloco_run_stopped_with_a_sync_pending_resumes_bitwise(tmp_path, two_pod_reference):
    full, part = two_pod_reference, tmp_path / "part"
    _train(part, 6)
    _train(part, STEPS, "--resume")

    want = _final_fingerprints(full)
    assert want[0] != want[1], "the two pods' inner states should differ between outer steps"
    assert _final_fingerprints(part) == want

    records = {r["step"]: r for r in read_metrics(full)}
    outer = {step: (r["outer_sync"], r["outer_fragment"]) for step, r in records.items() if r.get("outer_sync")}
    # Sync n starts after 2n inner steps and applies one step later, in the record of step 2n: the
    # two fragments in turn. (The last sync, started after the last step, applies in no step.)
    assert outer == {2 * n: (n, (n - 1) % 2) for n in range(1, STEPS // 2)}
    assert all(records[s]["dcn_bytes_sent"] > 0 for s in outer)
    assert all(r["dcn_bytes_sent"] == 0 for s, r in records.items() if s not in outer)
    resumed = {r["step"]: r for r in read_metrics(part)}
    assert {s: r["loss"] for s, r in resumed.items()} == {s: r["loss"] for s, r in records.items()}


def test_a_diloco_run_warm_starts_from_an_every_step_run_s_checkpoint(tmp_path, tmp_path_factory, env):
    """The DiLoCo paper's warm start, as a user gets it, on pods of two hosts: the every-step run of
    test_hosts (shared by the session) saved step 4, kept in a folder of its own; `--resume` of a new
    run directory with sync.mode = "diloco" and checkpoint.warm_start_from naming that folder.
    Every pod takes that checkpoint, the outer state starts afresh from it (a baseline of the DiLoCo
    run is saved at once, the same on both pods), the cycle goes on from 4 inner steps, only the
    outer step moves bytes over the DCN, and the closing sample is written. (The run's own
    checkpoint directory, the default, is the same path with another folder: test_resume.py.)"""
    every_step = two_hosts_reference(tmp_path_factory, env).run_dir / "checkpoints" / "4"
    elsewhere = tmp_path / "every-step-run"
    shutil.copytree(every_step, elsewhere / "4")
    run_dir = tmp_path / "run"
    # The shared run's schedule (8 steps) and its evaluation and sample; DiLoCo's settings from SYNC.
    sets = [arg for setting in [*SYNC[:6], f"checkpoint.warm_start_from={elsewhere}"] for arg in ("--set", setting)]
    done = run_cli("local", *TWO_HOSTS, "--config", TINY, "--steps", "8", "--no-report", "--run-dir", str(run_dir),
                   "--resume", "--set", "dcn.timeout_s=30", "--set", "run.step_timeout_s=90", *sets, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DiLoCo warm start" in done.stdout, done.stdout[-3000:]

    restored = [e for e in _events(run_dir) if e["event"] == "restored"]
    assert [(e["step"], e.get("warm_start")) for e in restored] == [(4, True)]
    assert restored[0]["path"] == str(elsewhere / "4")
    assert len(set(_final_fingerprints(run_dir, 4))) == 1, "both pods start the DiLoCo run from one state"
    final = _final_fingerprints(run_dir, 8)
    assert final[0] != final[1], "the pods' inner states should differ after their own inner steps"

    records = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == [4, 5, 6, 7]
    # Sync 2 would have started after inner step 4, in the every-step part: the first is sync 3.
    assert {s: (r["outer_sync"], r["outer_fragment"]) for s, r in records.items() if r.get("outer_sync")} == \
        {6: (3, 0)}
    assert records[6]["dcn_bytes_sent"] > 0
    assert all(records[s]["dcn_bytes_sent"] == 0 for s in (4, 5, 7))
    assert json.loads((run_dir / "summary.json").read_text())["sample"]


def test_diloco_on_pods_of_two_hosts_trains_bitwise_like_one_host_with_both_devices(tmp_path):
    """2 pods of 2 hosts (each host exchanges its half of a fragment with the same host of the other
    pod; the pod's hosts gather the halves) against 2 pods of one host with 2 devices, int4 outer
    gradients: every step's loss and agreed-state checksum, the outer steps, the evaluation, the
    closing sample and every pod's own final checkpoint (which holds a sync pending: sync 4 starts
    after the last step) are bitwise alike."""
    sets = [arg for setting in [*SYNC[:5], "dcn.timeout_s=30", "run.step_timeout_s=90"] for arg in ("--set", setting)]
    layouts = {"hosts": ("--hosts-per-pod", "2", "--devices-per-host", "1"), "single": ("--devices-per-pod", "2")}

    def train(name: str):
        return run_cli("local", "--pods", "2", *layouts[name], "--config", TINY, "--steps", "8", "--no-report", *sets,
                       "--run-dir", str(tmp_path / name), timeout=600)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = dict(zip(layouts, pool.map(train, layouts)))
    for name, result in done.items():
        assert result.returncode == 0, f"{name}: " + result.stderr[-3000:]
    hosts, single = (read_metrics(tmp_path / name) for name in layouts)
    fields = ("step", "loss", "checksums", "outer_sync", "outer_fragment", "outer_pods")
    assert [[r.get(f) for f in fields] for r in hosts] == [[r.get(f) for f in fields] for r in single]
    assert {r["step"]: r["outer_sync"] for r in hosts if r.get("outer_sync")} == {2: 1, 4: 2, 6: 3}
    assert len({r["checksums"][0] for r in hosts}) == 4 and all(len(set(r["checksums"])) == 1 for r in hosts)
    for a, b in zip(hosts, single):     # each host sends its block: about half of the pod's bytes
        assert (a["dcn_bytes_sent"] > 0) == (b["dcn_bytes_sent"] > 0), a["step"]
        assert a["dcn_bytes_sent"] < 0.6 * b["dcn_bytes_sent"] or b["dcn_bytes_sent"] == 0, a["step"]
    evals = [[(e["trained_steps"], e["eval_loss"], e["eval_tokens"]) for e in read_evals(tmp_path / name)]
             for name in layouts]
    assert evals[0] == evals[1] and [e[0] for e in evals[0]] == [8]
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in layouts]
    assert summaries[0]["sample"] and summaries[0]["sample"] == summaries[1]["sample"]
    assert summaries[0]["checksum"] == summaries[1]["checksum"]
    # What the final checksum is of, named to the user: not the pods' own (differing) states.
    assert all(s["checksum_of"] == "agreed state" for s in summaries)
    assert f"final agreed state checksum {summaries[0]['checksum']} (identical on every pod)" in done["hosts"].stdout
    # `multipod generate` on the DiLoCo run's checkpoints (each pod's part under pod-N) writes the
    # closing sample again: the agreed parameters, read from pod 0's part.
    config = json.loads((tmp_path / "hosts" / "config.json").read_text())
    sample = config["sample"]
    generated = run_cli("generate", "--checkpoint", str(tmp_path / "hosts" / "checkpoints"), "--prompt",
                        sample["prompt"], "--max-tokens", str(sample["tokens"]), "--temperature",
                        str(sample["temperature"]), "--seed", str(config["run"]["seed"]), "--shift-context",
                        "--ignore-eos", timeout=240)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert "pod-0/8 (step 8)" in generated.stderr
    assert generated.stdout == summaries[0]["sample"] + "\n"
    assert checkpoint.read_metadata(str(tmp_path / "hosts" / "checkpoints" / "pod-0" / "8"))["outer"]["pending"]
    assert _final_fingerprints(tmp_path / "hosts", 8) == _final_fingerprints(tmp_path / "single", 8)


def _failure_args(policy: str, steps: int, *extra: str) -> tuple[str, ...]:
    sets = [arg for setting in ["sync.mode=diloco", "sync.inner_steps=4", "sync.overlap_steps=1",
                                f"sync.on_pod_failure={policy}", "sample.tokens=0", "eval.batches=0",
                                "data.global_batch=6", "dcn.timeout_s=30", "run.step_timeout_s=90",
                                "health.interval_s=0.5", "health.timeout_s=2", "optimizer.decay_steps=40", *extra]
            for arg in ("--set", setting)]
    return ("local", "--pods", "3", "--devices-per-pod", "1", "--config", TINY, "--steps", str(steps), "--no-report",
            *sets)


def _kill_pod_1(run_dir: pathlib.Path, args: tuple[str, ...], steps: int, env: dict) -> tuple[list[dict], list[dict]]:
    """Run `args`, SIGKILL pod 1 once step 10 is recorded, let the supervisor restart it and the run
    bring it back before the end; (step records, events)."""
    run = _Live(*args, "--run-dir", str(run_dir), env=dict(env, MULTIPOD_TEST_REJOIN_BY_STEP=str(steps - 6)))
    code = kill_and_finish(run, run_dir, lambda: _current_pid(run_dir, 1)[0], "degraded: 2/3 pods")
    assert code == 0, "".join(run.out) + "".join(run.err)
    records, events = read_metrics(run_dir), _events(run_dir)
    realigned = [e for e in events if e["event"] == "realigned"]
    if realigned:
        # The kill landed in an outer exchange that reached one survivor and not the other: the
        # live pods went back to the last checkpoint together, so the steps after it ran twice
        # (counted in lost_steps) and each step's last record is the one that counts.
        (back,) = realigned
        redone = len(records) - steps
        assert redone > 0 and json.loads((run_dir / "summary.json").read_text())["lost_steps"] == redone
        assert [r["step"] for r in records[-(steps - back["step"]):]] == list(range(back["step"], steps))
        records = sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or run twice"
    kinds = [e["event"] for e in events]
    assert "pod_failure" in kinds and "rejoin" in kinds
    rejoin = next(e for e in events if e["event"] == "rejoin")
    assert rejoin["step"] % 4 != 0, "a pod rejoins only where no outer sync is pending (tau = 1)"
    assert records[-1]["live_pods"] == 3
    return records, events


def test_a_killed_pod_is_dropped_from_the_outer_steps_and_rejoins_from_a_peer(tmp_path, env):
    """sync.on_pod_failure = "drop": 3 pods, pod 1 killed with SIGKILL; the survivors train on, the
    outer steps average over them (an event names the pods averaged), and the restarted pod
    rejoins at an outer boundary from a peer's state; the agreed state stays bitwise alike on
    every pod at every step (the run itself checks it)."""
    steps = 40
    records, events = _kill_pod_1(tmp_path, _failure_args("drop", steps, "checkpoint.every=0"), steps, env)
    dropped = [e for e in events if e["event"] == "outer_dropped"]
    assert dropped and all(e["pods"] == [0, 2] and e["dropped"] == [1] for e in dropped)
    outer = [r for r in records if r.get("outer_sync")]
    assert outer[-1]["outer_pods"] == [0, 1, 2], "the rejoined pod takes part in the outer steps again"


REPLAY_STEPS = 40
REPLAY_ARGS = _failure_args("replay", REPLAY_STEPS, "checkpoint.every=8", "checkpoint.keep=8")


@pytest.fixture(scope="module")
def replay_reference(tmp_path_factory) -> pathlib.Path:
    """The uninterrupted run of REPLAY_ARGS, for the replay tests below to compare with."""
    reference = tmp_path_factory.mktemp("diloco-replay") / "reference"
    done = run_cli(*REPLAY_ARGS, "--run-dir", str(reference))
    assert done.returncode == 0, done.stderr[-3000:]
    return reference


def _same_as_reference(records: list[dict], reference: pathlib.Path) -> None:
    """Every step's agreed state, and its loss where all of it was computed, are the reference's."""
    want = {r["step"]: r for r in read_metrics(reference)}
    for r in records:
        assert r["checksums"][0] == want[r["step"]]["checksums"][0], r["step"]
        if not r.get("partial_loss"):
            assert r["loss"] == want[r["step"]]["loss"], r["step"]


def test_a_killed_pod_s_inner_steps_are_replayed_and_the_run_ends_bitwise(tmp_path, env, replay_reference):
    """sync.on_pod_failure = "replay" (the default): 3 pods, pod 1 killed with SIGKILL after a
    checkpoint; the survivor hosting its slot rebuilds its state from its checkpoint part, trains it
    beside its own, and hands it back when the restarted pod rejoins. Every step's agreed state and
    loss, and every pod's own final checkpoint, are bitwise the uninterrupted run's. The
    checkpoints taken while pod 1 was out are whole (its part written by its replica's host,
    bitwise the uninterrupted run's part), and a run resumed from the last of them with every pod
    back ends bitwise as the uninterrupted run, skipping a newer checkpoint pod 2's part of which is
    missing."""
    steps, args, reference = REPLAY_STEPS, REPLAY_ARGS, replay_reference
    records, events = _kill_pod_1(tmp_path / "killed", args, steps, env)
    replay = next(e for e in events if e["event"] == "replay")
    # From the last good checkpoint: step 8's, or the baseline if 8's was still being written (up to
    # the survivors' step; or, if they were realigned at that checkpoint, nothing to retake).
    realigned = [e["step"] for e in events if e["event"] == "realigned"]
    assert replay["slot"] == 1 and replay["from_step"] in (0, 8)
    assert replay["to_step"] == realigned[0] if realigned else replay["to_step"] > 10
    assert not any(e["event"] == "outer_dropped" for e in events)
    _same_as_reference(records, reference)
    want = {r["step"]: r for r in read_metrics(reference)}
    assert [_part(tmp_path / "killed", pod, steps) for pod in range(3)] == \
        [_part(reference, pod, steps) for pod in range(3)]

    out_from = next(e["step"] for e in events if e["event"] == "degraded")
    back_at = next(e["step"] for e in events if e["event"] == "rejoin")
    degraded = [e["step"] for e in events if e["event"] == "checkpoint_saved" and out_from < e["step"] <= back_at]
    assert degraded, f"no checkpoint was saved while pod 1 was out (steps {out_from}-{back_at})"
    # Every save started once pod 1 was out succeeded. (A save under way when it was killed may fail,
    # and its failure is reported when the controller next waits on it: after the degraded event.)
    out_at = next(i for i, e in enumerate(events) if e["event"] == "degraded")
    started = [(i, e["step"]) for i, e in enumerate(events) if i > out_at and e["event"] == "checkpoint_started"]
    assert started
    for i, step in started:
        ended = next((e["event"] for e in events[i:] if e["event"] in ("checkpoint_saved", "checkpoint_failed")
                      and e["step"] == step), "never ended")
        assert ended == "checkpoint_saved", (step, [e for e in events if e["event"] == "checkpoint_failed"])
    for step in degraded:
        assert [_part(tmp_path / "killed", pod, step) for pod in range(3)] == \
            [_part(reference, pod, step) for pod in range(3)], step
    resumed = tmp_path / "resumed"
    for pod in range(3):
        shutil.copytree(tmp_path / "killed" / "checkpoints" / f"pod-{pod}" / str(degraded[-1]),
                        resumed / "checkpoints" / f"pod-{pod}" / str(degraded[-1]))
    # A newer checkpoint that is not whole (pod 2's part never written, as if its save failed):
    # --resume skips it, saying why, and the resumed run writes that step again over pods 0 and 1's.
    for pod in (0, 1):
        shutil.copytree(tmp_path / "killed" / "checkpoints" / f"pod-{pod}" / str(steps),
                        resumed / "checkpoints" / f"pod-{pod}" / str(steps))
    done = run_cli(*args, "--run-dir", str(resumed), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"skipping the checkpoint of step {steps}, it is not whole: pod 2's part is missing" in done.stdout
    resumed_events = _events(resumed)
    restored = next(e for e in resumed_events if e["event"] == "restored")
    assert restored["step"] == degraded[-1] and restored["skipped"] == [{"step": steps, "parts": {"2": "missing"}}]
    assert not [e for e in resumed_events if e["event"] == "checkpoint_failed"], "step 40 was not written again"
    assert [r["step"] for r in read_metrics(resumed)] == list(range(degraded[-1], steps))
    assert [r["checksums"] for r in read_metrics(resumed)] == \
        [want[s]["checksums"] for s in range(degraded[-1], steps)]
    assert [_part(resumed, pod, steps) for pod in range(3)] == [_part(reference, pod, steps) for pod in range(3)]


def test_an_outer_exchange_that_reached_one_survivor_sends_the_live_pods_back_to_the_checkpoint(
        tmp_path, env, replay_reference):
    """Pod 1 dies in the all-gather of outer sync 3 (a test hook): its reduced slices reached pod 0
    and not pod 2, so pod 0 applied that outer step and pod 2 could not. A peer's DiLoCo state
    cannot stand in for another's, so the live pods go back to the last good checkpoint (step 8)
    together, pod 1's slot is replayed there, the restarted pod rejoins, and every step's agreed
    state is the uninterrupted run's; the steps run twice are counted as lost."""
    steps, run_dir, marker = REPLAY_STEPS, tmp_path / "run", tmp_path / "gather-to-one-fired"
    run = _Live(*REPLAY_ARGS, "--run-dir", str(run_dir),
                env=dict(env, MULTIPOD_TEST_GATHER_TO_ONE=f"1:3:{marker}",
                         MULTIPOD_TEST_REJOIN_BY_STEP=str(steps - 6)))
    try:
        code = run.finish(400)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert code == 0, "".join(run.out) + "".join(run.err)
    assert marker.exists(), "the hook never fired"
    events = _events(run_dir)
    (back,) = [e for e in events if e["event"] == "realigned"]
    assert back["step"] == 8 and len(set(back["steps"].values())) == 2, back
    assert sorted(back["steps"]) == ["0", "2"]
    records = read_metrics(run_dir)
    redone = len(records) - steps
    assert redone > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["realigned"] == 1 and summary["lost_steps"] == redone
    assert [r["step"] for r in records[-(steps - 8):]] == list(range(8, steps))
    last = sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])
    assert [r["step"] for r in last] == list(range(steps)), "a step was lost"
    kinds = [e["event"] for e in events]
    assert "replay" in kinds and "rejoin" in kinds and last[-1]["live_pods"] == 3
    _same_as_reference(last, replay_reference)
    assert [_part(run_dir, pod, steps) for pod in range(3)] == [_part(replay_reference, pod, steps) for pod in range(3)]


def _part(run_dir: pathlib.Path, pod: int, step: int) -> str:
    return checkpoint.read_metadata(str(run_dir / "checkpoints" / f"pod-{pod}" / str(step)))["fingerprint"]


def test_with_recovery_restore_a_killed_pod_sends_every_pod_back_to_its_own_part_bitwise(
        tmp_path, env, two_pod_reference):
    """recovery.on_pod_failure = "restore" in a DiLoCo run: pod 1 killed with SIGKILL, every pod goes
    back to its own part of the last checkpoint, and the run ends with every pod's final checkpoint
    bitwise the uninterrupted run's."""
    run_dir = tmp_path / "killed"
    run = _Live(*_two_pods(STEPS), "--run-dir", str(run_dir), env=env)
    code = kill_and_finish(run, run_dir, lambda: _current_pid(run_dir, 1)[0], "recovered", step=7)
    assert code == 0, "".join(run.out) + "".join(run.err)
    assert any(e["event"] == "recovered" for e in _events(run_dir))
    assert _final_fingerprints(run_dir) == _final_fingerprints(two_pod_reference)
