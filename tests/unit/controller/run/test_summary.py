"""The end-of-run summary's account of waits on slower pods (peer_wait_s) and on the link (wire_wait_s)."""
from __future__ import annotations

from types import SimpleNamespace

from multipod.controller.run.summary import Summary, link_line, median_waits, print_summary, straggler_line


def _record(*waits: float, wire: float = 0.0):
    return SimpleNamespace(pods=[SimpleNamespace(pod=p, peer_wait_s=w, wire_wait_s=wire) for p, w in enumerate(waits)])


def _summary(waits: dict[str, float], step_s: float = 0.5, wire: dict[str, float] | None = None) -> Summary:
    return Summary(steps=10, first_loss=5.0, final_loss=3.0, eval_loss=None, eval_bits_per_byte=None,
                   checksum="ab", median_step_time_s=step_s, median_tokens_per_s=1.0, median_mfu=None,
                   median_hfu=None, sample=None, run_dir="/tmp/run", median_peer_wait_s=waits,
                   median_wire_wait_s=wire or {})


def test_each_pod_s_median_wait_is_over_the_steps_it_took_part_in():
    records = [_record(0.04, 0.0), _record(0.05, 0.001), _record(0.03, 0.0, 0.02), _record(0.5)]
    # The one-pod step (a degraded run down to one pod) waits on nobody and is left out.
    assert median_waits(records) == {"0": 0.04, "1": 0.0, "2": 0.02}
    assert median_waits([_record(0.1)]) == {}
    wires = [_record(0.0, 0.0, wire=w) for w in (0.01, 0.03, 0.02)]
    assert median_waits(wires, "wire_wait_s") == {"0": 0.02, "1": 0.02}


def test_the_pod_the_others_waited_on_is_named_when_the_wait_is_noticeable():
    line = straggler_line(_summary({"0": 0.04, "1": 0.0, "2": 0.03}))
    assert line is not None and "pod 0 40 ms, pod 1 0 ms, pod 2 30 ms" in line
    assert "the others waited on pod 1" in line
    assert straggler_line(_summary({"0": 0.02, "1": 0.0})) is None     # under 5% of a 0.5 s step
    assert straggler_line(_summary({"0": 0.0})) is None
    assert straggler_line(_summary({})) is None


def test_waits_on_the_link_are_named_when_noticeable_apart_from_slower_pods():
    line = link_line(_summary({"0": 0.0, "1": 0.0}, wire={"0": 0.06, "1": 0.01}))
    assert line is not None and "waiting on the link" in line and "pod 0 60 ms, pod 1 10 ms" in line
    assert "tune --dcn" in line
    # A straggler's wait is not the link's: only wire_wait_s counts here, and 5% of the step is the bar.
    assert link_line(_summary({"0": 0.2, "1": 0.0}, wire={"0": 0.02, "1": 0.0})) is None
    assert link_line(_summary({"0": 0.0}, wire={"0": 0.3})) is None         # one pod waits on no link


def test_the_printed_checksum_names_what_it_is_of(capsys):
    print_summary(_summary({}))
    assert "final state checksum ab (identical on every pod)" in capsys.readouterr().out
    diloco = _summary({})
    diloco.checksum_of = "agreed state"
    print_summary(diloco)
    assert "final agreed state checksum ab (identical on every pod)" in capsys.readouterr().out
