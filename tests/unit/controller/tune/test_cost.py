"""The cross-pod cost model (controller/tune/cost.py) on cases computed by hand: bytes on the wire
per encoding and pod count, fused against overlapped exposure, the ranking and the recommendation,
DiLoCo's amortised bytes and exposure, the streams' window cap, and errors naming the field."""
import dataclasses
import math

import numpy as np
import pytest

from multipod.controller.tune import cost
from multipod.controller.tune.cost import bytes_per_value, project
from multipod.controller.tune.cost_inputs import Calibration, Chip, Layout, Links, ModelShape, SyncChoice
from multipod.model.config import ConfigError, ModelConfig
from multipod.pod_worker.schema import Compression, OuterDtype, SyncConfig, SyncMode

P = 1 << 20                      # parameters: a whole number of 256-value blocks
# Arithmetic only: no efficiency loss, no overlapped-step costs, no jitter.
EXACT = Calibration(dcn_efficiency=1.0, program_launch_s=0.0, block0_recompute_layers=0.0)
# One chip of 1 TFLOP/s at MFU 1, 300 tokens per pod of 1e10 FLOPs: compute 3 s (forward 1 s, backward 2 s).
CHIP = Chip(1e12, 1.0)
MODEL = ModelShape(P, 1e10, n_layers=4, grad_bytes=4, last_ready_fraction=0.1)


def layout(pods=2, microbatches=1, hosts=1):
    return Layout(pods, hosts, hosts, 300 * pods, microbatches)


def links(gbps, latency_ms=0.0, streams=4):
    return Links(dcn_gbps=gbps, dcn_latency_ms=latency_ms, ici_gbps=1000.0, streams=streams)


def every_step(overlap=False, compression="none"):
    return SyncChoice(overlap=overlap, compression=Compression(compression))


def diloco(h, f, dtype="float32", tau=0):
    return SyncChoice(sync=SyncConfig(mode=SyncMode.DILOCO, inner_steps=h, fragments=f, overlap_steps=tau,
                                      outer_dtype=OuterDtype(dtype)))


def test_bytes_per_value_are_the_wire_codecs():
    assert bytes_per_value("none", 4) == 4 and bytes_per_value("none", 2) == 2
    assert bytes_per_value("bf16") == 2
    assert bytes_per_value("int8") == 1 + 4 / 256 == 1.015625
    assert bytes_per_value("int4") == 0.5 + 4 / 256 == 0.515625
    from multipod.pod_worker.dcn.wire import WireCodec  # the codec itself, on whole blocks
    for name in ("none", "bf16", "int8", "int4"):
        assert WireCodec(name).nbytes(256 * 1000, np.dtype(np.float32)) == bytes_per_value(name) * 256 * 1000


@pytest.mark.parametrize("compression, two_pods, four_pods", [
    ("none", 4 * P, 6 * P),                 # 4 pods: 2(N-1)/N = 1.5 of the gradient
    ("bf16", 2 * P, 3 * P),
    ("int8", 1_064_960, 1_597_440),         # P x 1.015625, x 1.5
    ("int4", 540_672, 811_008),             # P x 0.515625, x 1.5
])
def test_dcn_bytes_per_step_for_2_and_4_pods(compression, two_pods, four_pods):
    for pods, expected in ((2, two_pods), (4, four_pods)):
        projection = project(MODEL, layout(pods), CHIP, links(8.0), every_step(compression=compression), EXACT)
        assert projection.dcn_bytes_per_step == pytest.approx(expected, rel=1e-12)
    assert project(MODEL, layout(1), CHIP, links(8.0), every_step(), EXACT).dcn_bytes_per_step == 0


def test_fused_exposes_the_whole_exchange_and_overlap_hides_it_under_the_backward_pass():
    # Compute 3 s (the backward 2 s); the 4 MiB gradient in exactly 1 s.
    gbps = 8.0 * 4 * P / 1e9
    fused = project(MODEL, layout(), CHIP, links(gbps), every_step(), EXACT)
    assert (fused.forward_s, fused.backward_s) == pytest.approx((1.0, 2.0))
    assert fused.exchange_s == pytest.approx(1.0)
    assert fused.exposed_s == pytest.approx(1.0) and fused.step_s == pytest.approx(4.0)
    assert fused.weak_scaling == pytest.approx(0.75)
    overlapped = project(MODEL, layout(), CHIP, links(gbps), every_step(overlap=True), EXACT)
    assert overlapped.exposed_s == pytest.approx(0.1)     # hidden but the tail: 10% ready at the end
    assert overlapped.step_s == pytest.approx(3.1)
    # An exchange of 8 s: the 2 s backward hides 2 s of it.
    slow = project(MODEL, layout(), CHIP, links(gbps / 8), every_step(overlap=True), EXACT)
    assert slow.exposed_s == pytest.approx(6.0) and slow.step_s == pytest.approx(9.0)
    # Microbatches: only the last one's backward (2 s / 4) hides the exchange.
    micro = project(MODEL, layout(microbatches=4), CHIP, links(gbps), every_step(overlap=True), EXACT)
    assert micro.exposed_s == pytest.approx(0.5)


def test_latency_is_one_round_for_2_pods_and_two_for_more():
    # 8 streams' windows (8 x 4 MiB per 20 ms round trip) do not cap the 1e9 B/s link.
    two = project(MODEL, layout(2), CHIP, links(8.0, latency_ms=10, streams=8), every_step(), EXACT)
    four = project(MODEL, layout(4), CHIP, links(8.0, latency_ms=10, streams=8), every_step(), EXACT)
    assert two.exchange_s == pytest.approx(4 * P / 1e9 + 0.010)
    assert four.exchange_s == pytest.approx(6 * P / 1e9 + 0.020)


def test_overlapped_ranks_above_fused_only_when_the_exchange_outlasts_its_cost():
    # The overlapped step's own cost: 11 programs x 10 ms = 0.11 s; its tail 10% of the exchange.
    cal = Calibration(dcn_efficiency=1.0, program_launch_s=0.01, block0_recompute_layers=0.0)
    fast, _ = cost.plan(MODEL, layout(), CHIP, links(8000.0), cal=cal)      # exchange 4 ms
    exact = [p.choice.label() for p in fast if p.tier == "exact"]
    assert exact == ["every step, fused, none", "every step, overlapped, none"]
    slow, best = cost.plan(MODEL, layout(), CHIP, links(8.0 * 4 * P / 1e9), cal=cal)   # exchange 1 s > tail + cost
    exact = [p for p in slow if p.tier == "exact"]
    assert [p.choice.label() for p in exact] == ["every step, overlapped, none", "every step, fused, none"]
    assert exact[0].step_s == pytest.approx(3 + 0.11 + 0.1) and exact[1].step_s == pytest.approx(4.0)
    assert best is exact[0]
    assert [p.tier for p in slow] == sorted(p.tier for p in slow)      # "exact" then "lossy"


def test_diloco_bytes_per_step_are_a_fragments_bytes_over_its_period():
    for pods, factor in ((2, 1.0), (4, 1.5)):
        p = project(MODEL, layout(pods), CHIP, links(8.0), diloco(20, 4, "int4"), EXACT)
        fragment = P / 4 * 0.515625 * factor
        assert p.dcn_bytes_per_step == pytest.approx(fragment / 5)         # H / F = 5 steps
    full = project(MODEL, layout(), CHIP, links(8.0), diloco(25, 1), EXACT)
    every = project(MODEL, layout(), CHIP, links(8.0), every_step(), EXACT)
    assert every.dcn_bytes_per_step / full.dcn_bytes_per_step == pytest.approx(25)


def test_diloco_hides_a_fragment_in_its_overlap_steps_and_amortises_the_rest():
    gbps = 8.0 * 4 * P / 4 / 1e9 / 5      # a float32 fragment (P / 4 values) in exactly 5 s
    bare = project(MODEL, layout(), CHIP, links(gbps), diloco(20, 4), EXACT)
    assert bare.exchange_s == pytest.approx(5.0)
    assert bare.exposed_s == pytest.approx(5.0 / 5) and bare.step_s == pytest.approx(3.0 + 1.0)
    one = project(MODEL, layout(), CHIP, links(gbps), diloco(20, 4, tau=1), EXACT)     # 3 s of inner step
    assert one.exposed_s == pytest.approx(2.0 / 5)
    two = project(MODEL, layout(), CHIP, links(gbps), diloco(20, 4, tau=2), EXACT)
    assert two.exposed_s == 0 and two.weak_scaling == pytest.approx(1.0)
    # The candidates pick the fewest overlap steps that hide it.
    chosen = [c for c in cost.candidates(MODEL, layout(), CHIP, links(gbps), EXACT)
              if c.sync.diloco and (c.sync.inner_steps, c.sync.fragments, c.sync.outer_dtype) == (20, 4, "float32")]
    assert [c.sync.overlap_steps for c in chosen] == [2]


def test_diloco_is_proposed_on_pods_of_several_hosts_as_on_pods_of_one():
    # multipod runs DiLoCo on pods of several hosts (pod_worker/diloco_hosts.py).
    assert cost.DILOCO_ON_SEVERAL_HOSTS
    def grid(hosts: int) -> set:
        return {(c.sync.inner_steps, c.sync.fragments, c.sync.outer_dtype)
                for c in cost.candidates(MODEL, layout(hosts=hosts), CHIP, links(8.0), EXACT) if c.sync.diloco}
    assert grid(2) and grid(2) == grid(1)


def test_the_streams_windows_cap_a_long_link():
    # 10 ms each way: one 4 MiB window per 20 ms round trip is 209.7 MB/s; 10 Gb/s needs 6 streams.
    link = links(10.0, latency_ms=10, streams=1)
    one = cost.effective_dcn_bytes_per_s(link, layout(), 1, EXACT)
    assert one == pytest.approx(4 * 2**20 / 0.02)
    assert cost.streams_needed(link, layout(), EXACT) == math.ceil(10e9 / 8 / one) == 6
    assert cost.effective_dcn_bytes_per_s(link, layout(hosts=2), 1, EXACT) == pytest.approx(2 * one)
    assert cost.streams_needed(links(10.0, latency_ms=0), layout(), EXACT) == 4     # no cap: as given


def test_the_recommendation_keeps_math_changing_candidates_apart():
    slow = links(0.001)               # 4 MiB at 12.5 kB/s: every-step sync is mostly waiting
    ranked, best = cost.plan(MODEL, layout(), CHIP, slow, allow_lossy=False, cal=EXACT)
    assert not best.choice.lossy and best.choice.overlap
    assert min(ranked, key=lambda p: p.step_s).choice.lossy
    _, lossy = cost.plan(MODEL, layout(), CHIP, slow, allow_lossy=True, cal=EXACT)
    assert lossy.choice.lossy and lossy.step_s < best.step_s * 0.95
    # Of the lossy ones within 2% of the fastest, the least lossy: no DiLoCo where int8 suffices etc.
    near = [p for p in ranked if p.choice.lossy and p.step_s <= lossy.step_s * 1.02 + 1e-12]
    assert lossy.choice.lossiness() == min(p.choice.lossiness() for p in near)
    # A link fast enough that nothing lossy gains 5%: exact sync even when lossy is allowed.
    _, fast = cost.plan(MODEL, layout(), CHIP, links(8000.0), allow_lossy=True, cal=EXACT)
    assert not fast.choice.lossy


def test_from_config_counts_the_models_parameters_and_flops():
    model = ModelConfig()
    shape = ModelShape.from_config(model, 128)
    assert shape.params == model.param_count() and shape.flops_per_token == model.flops_per_token(128)
    d = model.d_model
    block0 = d + 2 * d * model.n_heads * model.head_dim + 2 * d * model.n_kv_heads * model.head_dim
    assert shape.last_ready_fraction == pytest.approx((model.vocab_size * d + block0) / model.param_count())
    assert ModelShape.from_config(ModelConfig(param_dtype="bfloat16"), 128).grad_bytes == 2
    assert ModelShape.from_params(1000, 10).flops_per_token == 6000


def test_expected_max_of_normals():
    assert cost.expected_max_normal(1) == 0
    assert cost.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    jittery = Calibration(dcn_efficiency=1.0, program_launch_s=0.0, block0_recompute_layers=0.0, jitter_cv=0.1)
    p = project(MODEL, layout(), CHIP, links(8000.0), every_step(), jittery)
    assert p.jitter_s == pytest.approx(0.1 * 3.0 / math.sqrt(math.pi), rel=1e-6)


@pytest.mark.parametrize("part, field", [
    (Links(dcn_gbps=0.0, dcn_latency_ms=1.0, ici_gbps=10.0), "dcn_gbps"),
    (Links(dcn_gbps=1.0, dcn_latency_ms=1.0, ici_gbps=-5.0), "ici_gbps"),
    (Links(dcn_gbps=1.0, dcn_latency_ms=-1.0, ici_gbps=10.0), "dcn_latency_ms"),
    (Links(dcn_gbps=1.0, dcn_latency_ms=1.0, ici_gbps=10.0, streams=9), "streams"),
    (Chip(1e12, 46.2), "mfu"),
    (Layout(2, 3, 8, 100), "chips_per_pod"),
    (Layout(0, 1, 8, 100), "pods"),
    (ModelShape(0, 1.0, 1), "params"),
    (Calibration(dcn_efficiency=1.5), "dcn_efficiency"),
])
def test_bad_inputs_name_their_field(part, field):
    with pytest.raises(ConfigError) as error:
        part.validate()
    assert error.value.field == field


def test_the_step_overhead_is_added_once_to_every_candidates_step():
    # The fused step of 4 s (compute 3 s + exchange 1 s) and the overlapped one of 3.1 s each take
    # 0.25 s more, and so does a DiLoCo inner step (compute 3 s, its 1 s fragment hidden by
    # tau = 1): tune --dcn calibrates each kind of step's overhead on a run of that kind. Bytes as
    # before; on paper (no overhead) the DiLoCo step is its compute alone.
    gbps = 8.0 * 4 * P / 1e9
    cal = Calibration(dcn_efficiency=1.0, program_launch_s=0.0, block0_recompute_layers=0.0, step_overhead_s=0.25)
    assert project(MODEL, layout(), CHIP, links(gbps), every_step(), cal).step_s == pytest.approx(4.25)
    assert project(MODEL, layout(), CHIP, links(gbps), every_step(overlap=True), cal).step_s == pytest.approx(3.35)
    hidden = project(MODEL, layout(), CHIP, links(gbps), diloco(10, 1, tau=1), cal)
    assert hidden.exposed_s == pytest.approx(0.0) and hidden.step_s == pytest.approx(3.25)
    assert hidden.dcn_bytes_per_step == pytest.approx(4 * P / 10)
    paper = project(MODEL, layout(), CHIP, links(gbps), diloco(10, 1, tau=1),
                    dataclasses.replace(cal, step_overhead_s=0.0))
    assert paper.step_s == pytest.approx(3.0)
    with pytest.raises(ConfigError) as caught:
        Calibration(step_overhead_s=-0.1).validate()
    assert caught.value.field == "step_overhead_s"
