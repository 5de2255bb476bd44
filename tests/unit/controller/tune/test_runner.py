"""`multipod tune`'s runner: the line protocol with the layout probe, and what happens when a
probe crashes or hangs (a stand-in probe, so no jax is started)."""
import json
import sys

from multipod.controller.core.run_config import load_config
from multipod.controller.tune.grid import Candidate
from multipod.controller.tune.runner import row_summary, run_grid
from tests.helpers import TINY

# Speaks the layout probe's protocol; its behaviour per candidate is picked by the remat policy:
# none -> a result, full -> the process dies, selective -> it hangs. Each start is logged to a file.
FAKE_PROBE = r"""
import json, os, sys, time
spec = json.loads(sys.stdin.readline())
log = open(os.environ["FAKE_PROBE_LOG"], "a")
log.write(json.dumps([i for i, _ in spec["candidates"]]) + "\n"); log.flush()
print("some library chatter", flush=True)
print(json.dumps({"event": "ready", "device_kind": "fake", "num_devices": spec["devices"]}), flush=True)
for index, worker_json in spec["candidates"]:
    remat = json.loads(worker_json)["model"]["remat"]
    print(json.dumps({"event": "start", "index": index}), flush=True)
    if remat == "full":
        print("probe exploded", file=sys.stderr, flush=True)
        os._exit(3)
    if remat == "selective":
        time.sleep(3600)
    print(json.dumps({"event": "result", "index": index, "status": "ok", "step_time_s": 0.01 * (index + 1),
                      "memory_bytes": 2**20}), flush=True)
print(json.dumps({"event": "done"}), flush=True)
"""


def _run(candidates, tmp_path, monkeypatch, timeout_s=30.0):
    monkeypatch.setenv("FAKE_PROBE_LOG", str(tmp_path / "starts.jsonl"))
    results, info = run_grid(load_config(TINY), candidates, devices=2, per_pod_batch=8, steps=1, memory_limit=None,
                             timeout_s=timeout_s, command=[sys.executable, "-c", FAKE_PROBE])
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    return results, info, starts


def test_results_come_back_in_grid_order(tmp_path, monkeypatch):
    candidates = [Candidate(2, 1, False, 1, "none"), Candidate(1, 2, True, 1, "none")]
    results, info, starts = _run(candidates, tmp_path, monkeypatch)
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert [r["step_time_s"] for r in results] == [0.01, 0.02]
    assert info == {"device_kind": "fake", "num_devices": 2}
    assert starts == [[0, 1]]  # one probe did all of them


def test_a_crash_is_charged_to_the_running_candidate_and_the_search_goes_on(tmp_path, monkeypatch):
    candidates = [Candidate(2, 1, False, 1, "none"), Candidate(2, 1, False, 1, "full"),
                  Candidate(1, 2, True, 1, "none")]
    results, _, starts = _run(candidates, tmp_path, monkeypatch)
    assert [r["status"] for r in results] == ["ok", "error", "ok"]
    assert "the tuning process died (exit code 3)" in results[1]["error"]
    assert "probe exploded" in results[1]["error"]
    assert starts == [[0, 1, 2], [2]]  # a fresh probe for what was left
    assert row_summary(results[1]).startswith("error: the tuning process died")


def test_a_hang_is_charged_by_its_deadline(tmp_path, monkeypatch):
    candidates = [Candidate(2, 1, False, 1, "selective"), Candidate(2, 1, False, 1, "none")]
    # The deadline also covers starting a fresh Python for the probe, so it is not cut to the bone.
    results, _, starts = _run(candidates, tmp_path, monkeypatch, timeout_s=5.0)
    assert results[0] == {"status": "error", "error": "timed out: this candidate took more than 5s"}
    assert results[1]["status"] == "ok"
    assert starts == [[0, 1], [1]]
