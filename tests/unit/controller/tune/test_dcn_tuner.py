"""`multipod tune --dcn`'s pure parts (controller/tune/dcn_tuner.py, dcn_probe.py, dcn_trials.py):
candidates predicted from given link and compute values, overlapped ranked above fused when the
exchange outlasts the backward tail, the lossy tier kept apart and chosen only when allowed, bad
inputs refused naming the field, and the written config loads with the chosen settings."""
import argparse
import dataclasses

import pytest

from multipod.controller.core.run_config import ConfigError, load_config
from multipod.controller.tune import dcn_session, dcn_trials
from multipod.controller.tune.dcn_probe import ComputeMeasurement, LinkMeasurement, LinkVariant, given_link
from multipod.controller.tune.dcn_tuner import (
    StepKind,
    Trial,
    calibrate,
    calibrations,
    choose,
    diloco_proposed,
    diloco_reference,
    overrides,
    pick_trials,
    predict,
    rank_measured,
    reference,
    step_kind,
    trial_steps,
    trial_warmup,
    with_loss_deltas,
)
from multipod.controller.tune.table import write_config
from multipod.pod_worker.schema import Compression, Overlap, SyncMode
from tests.helpers import TINY

# A pod's step: forward 10 ms, backward 20 ms, update 5 ms; the overlapped step 2 ms dearer.
COMPUTE = ComputeMeasurement(step_s=0.035, compute_s=0.030, forward_s=0.010, overlapped_step_s=0.037)


def config():
    return load_config(TINY, ["model.vocab_size=256"])


def link(gbps, latency_ms=0.1, streams=(4,), chunks=(2 << 20,)):
    return given_link(gbps, latency_ms, list(streams), list(chunks))


def exact(ranked, overlap):
    return next(p for p in ranked if not p.choice.lossy and p.choice.overlap is overlap)


def test_overlapped_ranks_above_fused_when_the_exchange_outlasts_the_backward_tail():
    grad_bytes = config().model.param_count() * 4
    slow = grad_bytes * 8 / 0.010 / 1e9          # the whole gradient takes 10 ms: more than the tail
    ranked = predict(config(), COMPUTE, link(slow), 2, 2)
    fused, overlapped = exact(ranked, False), exact(ranked, True)
    assert fused.exposed_s == pytest.approx(0.010 + 0.0001, rel=1e-6)       # all of it, plus a round
    assert overlapped.exposed_s < fused.exposed_s
    assert overlapped.step_s < fused.step_s
    assert ranked.index(overlapped) < ranked.index(fused)
    # On a link so fast that the exchange is nothing, the per-layer programs' measured 2 ms lose.
    fast = predict(config(), COMPUTE, link(1e6, 0.0), 2, 2)
    assert fast.index(exact(fast, False)) < fast.index(exact(fast, True))


def test_calibration_reproduces_the_measured_compute_and_every_variant_is_a_candidate():
    two = LinkMeasurement(0.1, (LinkVariant(1, 1 << 20, 0.05), LinkVariant(4, 4 << 20, 0.2)))
    ranked = predict(config(), COMPUTE, two, 2, 2)
    p = ranked[0]
    assert p.forward_s == pytest.approx(0.010) and p.backward_s == pytest.approx(0.020)
    assert p.one_pod_step_s == pytest.approx(0.035)
    assert {(r.choice.streams, r.choice.chunk_bytes) for r in ranked} == {(1, 1 << 20), (4, 4 << 20)}
    one = [r for r in ranked if not r.choice.lossy and not r.choice.overlap]
    assert min(one, key=lambda r: r.step_s).choice.streams == 4      # the faster variant, all else equal
    assert all(not r.choice.lossy for r in ranked[:len([r for r in ranked if not r.choice.lossy])])
    assert {r.choice.compression for r in ranked} == {Compression.NONE, Compression.BF16, Compression.INT8}
    assert any(r.choice.sync.diloco for r in ranked)
    assert not any(r.choice.sync.diloco for r in predict(config(), COMPUTE, two, 2, 2, diloco=False))


def trial(p, measured, loss=2.0):
    return Trial(p, measured, loss)


def test_the_lossy_tier_is_chosen_only_when_allowed_and_faster_and_carries_its_loss_difference():
    ranked = predict(config(), COMPUTE, link(0.01), 2, 2)
    picked = pick_trials(ranked, 2, 2, max_steps=20, steps=10, warmup=2)
    assert [p.choice.lossy for p in picked] == [False, False, True, True]
    assert not any(p.choice.sync.diloco and trial_steps(p.choice, 10, 2) > 20 for p in picked)
    trials = [trial(picked[0], 0.050, 2.0), trial(picked[1], 0.040, 2.0), trial(picked[2], 0.020, 2.3),
              trial(picked[3], None)]
    trials = rank_measured(with_loss_deltas(trials))
    assert [t.measured_step_s for t in trials] == [0.040, 0.050, 0.020, None]     # exact first, failed last
    assert trials[2].loss_delta == pytest.approx(0.3)
    assert trials[0].loss_delta is None
    assert choose(trials, allow_lossy=False).measured_step_s == 0.040
    assert choose(trials, allow_lossy=True).measured_step_s == 0.020
    barely = [trials[0], dataclasses.replace(trials[2], measured_step_s=0.039)]   # < 5% faster: exact stays
    assert choose(barely, allow_lossy=True).measured_step_s == 0.040
    assert trials[0].prediction_error == pytest.approx((trials[0].projection.step_s - 0.040) / 0.040)


def test_a_diloco_trial_times_whole_periods_of_its_outer_syncs_after_each_fragment_s_first():
    ranked = predict(config(), COMPUTE, link(0.01), 2, 2)
    every_step = next(p.choice for p in ranked if not p.choice.sync.diloco)
    assert (trial_steps(every_step, 12, 2), trial_warmup(every_step, 2)) == (12, 2)
    by_period = {}
    for p in ranked:
        if p.choice.sync.diloco:
            by_period.setdefault(p.choice.sync.period, p.choice)
    assert {5, 10, 25} <= set(by_period)
    # The warm-up and every fragment's first outer sync untimed (each compiles its fragment's outer
    # programs; the last is applied tau steps after the F-th period ends), then two or more whole
    # periods timed.
    ten_two = next(p.choice for p in ranked if p.choice.sync.diloco and p.choice.sync.inner_steps == 10
                   and p.choice.sync.fragments == 2)
    five = dataclasses.replace(ten_two, sync=dataclasses.replace(ten_two.sync, overlap_steps=2))
    assert five.sync.period == 5 and trial_warmup(five, 2) == 2 + 10 + 2
    assert trial_steps(five, 12, 2) == 14 + 2 * 5
    assert trial_steps(five, 30, 2) == 14 + 4 * 5         # 16 steps left after 14: 4 periods
    twenty_five = dataclasses.replace(by_period[25], sync=dataclasses.replace(by_period[25].sync, overlap_steps=0))
    assert trial_steps(twenty_five, 12, 2) == 2 + twenty_five.sync.inner_steps + 2 * 25
    # --max-trial-steps bounds the trial as it will run.
    picked = pick_trials(ranked, 0, len(ranked), max_steps=60, steps=12, warmup=2)
    assert picked and all(trial_steps(p.choice, 12, 2) <= 60 for p in picked)
    assert {p.choice for p in picked} == {p.choice for p in ranked
                                          if p.choice.lossy and trial_steps(p.choice, 12, 2) <= 60}


def test_a_trial_sends_its_chunks_raw_as_the_cost_model_counts_them():
    # dcn.lossless = auto would pack them on a slow link: the model counts raw bytes.
    p = exact(predict(config(), COMPUTE, link(0.01, streams=(2,), chunks=(1 << 20,)), 2, 2), True)
    trial = load_config(TINY, dcn_trials.trial_overrides([], p.choice, 10))
    assert trial.dcn.lossless == "off" and trial.dcn.streams == 2 and trial.run.steps == 10


def test_the_trial_reads_its_step_time_and_loss_from_the_records():
    records = [{"loss": 3.0, "step_time_s": 9.0}] * 2 + [{"loss": 2.0, "step_time_s": t} for t in (0.1, 0.3, 0.2)]
    assert dcn_trials.summarize(records, diloco=False, warmup=2) == (pytest.approx(0.2), pytest.approx(2.0))
    assert dcn_trials.summarize(records, diloco=True, warmup=2)[0] == pytest.approx(0.2)
    assert dcn_trials.summarize(records[:2], diloco=False, warmup=2) == (None, None)
    # A longer (DiLoCo) trial's loss is read at the exact trials' length: the same batches.
    longer = records + [{"loss": 1.0, "step_time_s": 0.2}] * 4
    assert dcn_trials.summarize(longer, diloco=True, warmup=2, loss_at=5)[1] == pytest.approx(2.0)
    assert dcn_trials.summarize(longer, diloco=True, warmup=2)[1] == pytest.approx(1.0)


@pytest.mark.parametrize("given, latency, field", [(0.0, None, "--link-gbps"), (-1.0, None, "--link-gbps"),
                                                    (float("nan"), None, "--link-gbps"), (1.0, -2.0, "--latency-ms")])
def test_a_non_positive_bandwidth_or_negative_latency_is_refused_naming_the_flag(given, latency, field):
    with pytest.raises(ConfigError) as caught:
        given_link(given, latency, [4], [2 << 20])
    assert caught.value.field == field


def test_bad_measurements_and_pod_counts_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="link"):
        predict(config(), COMPUTE, LinkMeasurement(0.1, ()), 2, 2)
    with pytest.raises(ConfigError) as caught:
        predict(config(), COMPUTE, LinkMeasurement(0.1, (LinkVariant(4, 2 << 20, 0.0),)), 2, 2)
    assert caught.value.field == "--link-gbps"
    with pytest.raises(ConfigError) as caught:
        predict(config(), COMPUTE, link(1.0), 1, 2)
    assert caught.value.field == "--pods"
    with pytest.raises(ConfigError) as caught:
        predict(config(), dataclasses.replace(COMPUTE, forward_s=0.0), link(1.0), 2, 2)
    assert caught.value.field == "compute.forward_s"


def _args(**fields):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    dcn_session.add_arguments(parser)
    args = parser.parse_args(["--dcn"])
    for key, value in fields.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("fields, flag", [
    ({"workers": "a:1,b:2", "netns": True}, "--netns"), ({"netns_rate_gbps": 1.0}, "--netns-rate-gbps"),
    ({"netns": True, "netns_rate_gbps": 0.0}, "--netns-rate-gbps"), ({"link_gbps": 0.0}, "--link-gbps"),
    ({"latency_ms": 1.0}, "--latency-ms"), ({"trial_steps": 0}, "--trial-steps"),
    ({"warmup_steps": 12}, "--warmup-steps"), ({"compressions": "none,zip"}, "--compressions"),
    ({"run_lossy": -1}, "--run-lossy"), ({"max_trial_steps": 11}, "--max-trial-steps"),
    # Refused by the workers once the pods were up, as "no reachable link between the pods".
    ({"streams": [1, 9]}, "--streams"), ({"streams": [0]}, "--streams"),
    ({"chunk_bytes": [1 << 20, 0]}, "--chunk-bytes"), ({"chunk_bytes": [64 << 20]}, "--chunk-bytes"),
])
def test_bad_flags_are_refused_naming_the_flag(fields, flag):
    with pytest.raises(ConfigError) as caught:
        dcn_session.check_args(_args(**fields))
    assert caught.value.field == flag


@pytest.mark.parametrize("which", ["overlapped", "diloco"])
def test_the_chosen_settings_are_written_as_a_config_that_loads_with_them(tmp_path, which):
    ranked = predict(config(), COMPUTE, link(0.01, streams=(2,), chunks=(1 << 20,)), 2, 2)
    if which == "overlapped":
        p = exact(ranked, True)
    else:
        p = next(r for r in ranked if r.choice.sync.diloco)
    written = load_config(TINY, overrides(p.choice))
    write_config(tmp_path / "tuned.toml", written, ["written by a test"])
    loaded = load_config(str(tmp_path / "tuned.toml"))
    assert loaded.dcn.streams == 2 and loaded.dcn.chunk_bytes == 1 << 20
    if which == "overlapped":
        assert loaded.dcn.overlap is Overlap.ON and loaded.dcn.compression is Compression.NONE
        assert loaded.sync.mode is SyncMode.EVERY_STEP
    else:
        s = p.choice.sync
        assert loaded.sync.mode is SyncMode.DILOCO
        assert (loaded.sync.inner_steps, loaded.sync.fragments, loaded.sync.overlap_steps, loaded.sync.outer_dtype) \
            == (s.inner_steps, s.fragments, s.overlap_steps, s.outer_dtype)


def test_the_calibration_run_sets_compute_update_and_the_step_overhead():
    # The run: compute 40 ms (the probe's 30 ms alone), update + checksum 6 + 1 ms, step 60 ms, on
    # the link variant of 4 streams at 1 Gb/s with 0.1 ms rounds. Tiny's float32 gradient of B
    # bytes takes B * 8 / 1e9 s + 0.1 ms: the model's fused step is 40 + 7 + that; the overhead is
    # the rest of the 60 ms.
    grad_bytes = config().model.param_count() * 4
    records = [{"loss": 3.0, "step_time_s": 9.0, "compute_time_s": 9.0, "update_time_s": 1.0,
                "checksum_time_s": 0.0, "exposed_exchange_s": 1.0}] * 2 + \
        [{"loss": 2.0, "step_time_s": s, "compute_time_s": c, "update_time_s": 0.006, "checksum_time_s": 0.001,
          "exposed_exchange_s": 0.004} for s, c in ((0.050, 0.030), (0.060, 0.040), (0.070, 0.050))]
    two = LinkMeasurement(0.1, (LinkVariant(1, 1 << 20, 0.5), LinkVariant(4, 1 << 20, 1.0)))
    choice = reference(two)
    assert (choice.streams, choice.chunk_bytes, choice.overlap, choice.lossy) == (4, 1 << 20, False, False)
    run = dcn_trials.calibration_of(records, choice, warmup=2)
    assert (run.step_s, run.compute_s, run.update_s, run.steps) == pytest.approx((0.060, 0.040, 0.007, 3))
    exchange = grad_bytes * 8 / 1e9 + 0.0001
    cal = calibrate(config(), COMPUTE, two, 2, 2, run)[3]
    assert cal.update_s == pytest.approx(0.007)
    assert cal.step_overhead_s == pytest.approx(0.060 - 0.040 - 0.007 - exchange)
    ranked = predict(config(), COMPUTE, two, 2, 2, runs=(run,))
    ref = next(p for p in ranked if p.choice == choice)
    assert ref.step_s == pytest.approx(0.060)                        # by construction
    assert ref.forward_s == pytest.approx(0.040 / 3)                 # the probe's backward/forward = 2
    # A run faster than the model's parts gives no negative overhead.
    quick = dataclasses.replace(run, step_s=0.030)
    assert calibrate(config(), COMPUTE, two, 2, 2, quick)[3].step_overhead_s == 0.0
    assert dcn_trials.calibration_of(records[:2], choice, warmup=2) is None


def test_the_fused_and_the_overlapped_step_are_each_predicted_on_their_own_calibration_run():
    # Fused run: compute 40 ms, step 60 ms; overlapped run: compute 30 ms (it shares the cores
    # better), update + checksum 7 ms, step 45 ms. On a 1 Gb/s link tiny's exchange X = B * 8 / 1e9
    # + 0.1 ms is shorter than the overlapped run's backward (20 ms): only the tail is exposed, the
    # embedding's and block 0's share f of X - 0.1 ms, plus the round's 0.1 ms.
    grad_bytes = config().model.param_count() * 4
    two = LinkMeasurement(0.1, (LinkVariant(4, 1 << 20, 1.0),))
    fused_run = dcn_trials.RunCalibration(reference(two), 0.060, 0.040, 0.007, 0.004, 8)
    overlapped_run = dcn_trials.RunCalibration(reference(two, overlap=True), 0.045, 0.030, 0.007, 0.002, 8)
    calibrated = calibrations(config(), COMPUTE, two, 2, 2, (fused_run, overlapped_run))
    fused_cal, overlapped_cal = calibrated[StepKind.FUSED][3], calibrated[StepKind.OVERLAPPED][3]
    assert overlapped_cal.program_launch_s == 0.0          # inside the overlapped run's compute
    assert fused_cal.program_launch_s == pytest.approx(0.002 / ((2 * 2 + 3) * 1))    # the probes' 2 ms
    exchange = grad_bytes * 8 / 1e9 + 0.0001
    shape = calibrated[StepKind.OVERLAPPED][0]
    tail = shape.last_ready_fraction * (exchange - 0.0001) + 0.0001
    assert overlapped_cal.step_overhead_s == pytest.approx(0.045 - 0.030 - 0.007 - tail)
    ranked = predict(config(), COMPUTE, two, 2, 2, runs=(fused_run, overlapped_run))
    assert exact(ranked, True).step_s == pytest.approx(0.045) and exact(ranked, False).step_s == pytest.approx(0.060)
    assert exact(ranked, True).forward_s == pytest.approx(0.010)
    # DiLoCo's inner step is the step the trainer resolves: the overlapped one's terms if so.
    diloco = next(p for p in predict(config(), COMPUTE, two, 2, 2, runs=(fused_run, overlapped_run),
                                     diloco_overlap=True) if p.choice.sync.diloco)
    assert diloco.one_pod_step_s == pytest.approx(0.030 + 0.007)
    # ... with no overhead: the every-step runs' residual is exchange an inner step does not send.
    assert diloco.step_s == pytest.approx(diloco.one_pod_step_s + diloco.exposed_s)


def test_diloco_is_predicted_on_its_own_calibration_run_of_inner_steps():
    # The DiLoCo run trains inner steps only (H beyond its steps): compute 35 ms, update 7 ms, step
    # 50 ms, so 8 ms of overhead, which every DiLoCo candidate (and no every-step one) carries.
    two = LinkMeasurement(0.1, (LinkVariant(4, 1 << 20, 1.0),))
    choice = diloco_reference(two, steps=12)
    assert choice.sync.diloco and choice.sync.inner_steps == 13 and choice.sync.period > 12
    assert (choice.streams, choice.chunk_bytes) == (4, 1 << 20)
    assert step_kind(choice) is StepKind.DILOCO_INNER
    fused_run = dcn_trials.RunCalibration(reference(two), 0.060, 0.040, 0.007, 0.004, 8)
    diloco_run = dcn_trials.RunCalibration(choice, 0.050, 0.035, 0.007, 0.0, 8)
    calibrated = calibrations(config(), COMPUTE, two, 2, 2, (fused_run, diloco_run))
    assert calibrated[StepKind.DILOCO_INNER][3].step_overhead_s == pytest.approx(0.008)
    ranked = predict(config(), COMPUTE, two, 2, 2, runs=(fused_run, diloco_run))
    for p in ranked:
        if p.choice.sync.diloco:
            assert p.one_pod_step_s == pytest.approx(0.042)
            assert p.step_s == pytest.approx(0.050 + p.exposed_s + p.ici_s + p.jitter_s)
    assert exact(ranked, False).step_s == pytest.approx(0.060)     # the fused run's, untouched


@pytest.mark.parametrize("shaped_gbps, hosts", [(None, 1), (1.25, 1), (None, 2)])
def test_the_plan_file_projects_each_kind_of_step_as_tune_predicted_it(tmp_path, capsys, shaped_gbps, hosts):
    # `tune --dcn --plan-out`: `multipod plan --from` the written file, with the measured cluster
    # and the calibration of one kind of step, projects the candidates of that kind as tune did.
    # With a shaped rate the file gives the link's rate and the data plane's share of it; with
    # pods of several hosts, their hosts.
    import json

    from multipod.cli import build_parser
    from multipod.controller.commands import run
    from multipod.controller.tune.dcn_plan_file import plan_document, write_plan_file
    two = LinkMeasurement(0.1, (LinkVariant(4, 1 << 20, 1.0),), {"int8": 5e8})
    runs = (dcn_trials.RunCalibration(reference(two), 0.060, 0.040, 0.007, 0.004, 8),
            dcn_trials.RunCalibration(reference(two, overlap=True), 0.045, 0.030, 0.007, 0.002, 8),
            dcn_trials.RunCalibration(diloco_reference(two, 12), 0.050, 0.035, 0.007, 0.0, 8))
    calibrated = calibrations(config(), COMPUTE, two, 2, 2, runs, hosts_per_pod=hosts)
    ranked = predict(config(), COMPUTE, two, 2, 2, runs=runs, hosts_per_pod=hosts)
    for kind in StepKind:
        if kind is StepKind.DILOCO_INNER and not diloco_proposed(hosts):
            continue        # neither tune nor plan proposes DiLoCo on these pods
        _, _, chip, calibration = calibrated[kind]
        path = tmp_path / f"{kind.name}.toml"
        write_plan_file(path, plan_document(config(), two, 2, 2, chip, calibration, shaped_gbps, hosts),
                        ["a header", ""])
        assert path.read_text().startswith("# a header\n\n")
        code = run(build_parser().parse_args(["plan", "--from", str(path), "--allow-lossy", "--json"]))
        report = json.loads(capsys.readouterr().out)
        assert code == 0
        assert report["inputs"]["layout"]["hosts_per_pod"] == hosts
        if shaped_gbps:
            assert report["inputs"]["links"]["dcn_gbps"] == shaped_gbps
            assert report["calibration"]["dcn_efficiency"] == pytest.approx(1.0 / shaped_gbps)
        # The same candidates by label (the plan's chunk size is dcn's default: no chunk cost here).
        planned = {c["label"]: c["step_s"] for c in report["candidates"]}
        compared = 0
        for p in ranked:
            if step_kind(p.choice) is kind and p.choice.label() in planned:
                assert planned[p.choice.label()] == pytest.approx(p.step_s, rel=1e-9), p.choice.label()
                compared += 1
        assert compared >= 2, kind
