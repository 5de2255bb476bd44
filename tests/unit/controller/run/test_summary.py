"""The end-of-run summary's account of waits on slower pods (peer_wait_s)."""
from __future__ import annotations

from types import SimpleNamespace

from multipod.controller.run.summary import Summary, median_peer_waits, straggler_line


def _record(*waits: float):
    return SimpleNamespace(pods=[SimpleNamespace(pod=p, peer_wait_s=w) for p, w in enumerate(waits)])


def _summary(waits: dict[str, float], step_s: float = 0.5) -> Summary:
    return Summary(steps=10, first_loss=5.0, final_loss=3.0, eval_loss=None, eval_bits_per_byte=None,
                   checksum="ab", median_step_time_s=step_s, median_tokens_per_s=1.0, median_mfu=None,
                   median_hfu=None, sample=None, run_dir="/tmp/run", median_peer_wait_s=waits)


def test_each_pod_s_median_wait_is_over_the_steps_it_took_part_in():
    records = [_record(0.04, 0.0), _record(0.05, 0.001), _record(0.03, 0.0, 0.02), _record(0.5)]
    # The one-pod step (a degraded run down to one pod) waits on nobody and is left out.
    assert median_peer_waits(records) == {"0": 0.04, "1": 0.0, "2": 0.02}
    assert median_peer_waits([_record(0.1)]) == {}


def test_the_pod_the_others_waited_on_is_named_when_the_wait_is_noticeable():
    line = straggler_line(_summary({"0": 0.04, "1": 0.0, "2": 0.03}))
    assert line is not None and "pod 0 40 ms, pod 1 0 ms, pod 2 30 ms" in line
    assert "the others waited on pod 1" in line
    assert straggler_line(_summary({"0": 0.02, "1": 0.0})) is None     # under 5% of a 0.5 s step
    assert straggler_line(_summary({"0": 0.0})) is None
    assert straggler_line(_summary({})) is None
