"""The layout probe: compile and time candidate layouts of one pod, in a process of its own.

    python -m multipod.pod_worker.layout_probe < spec.json

`multipod tune` (controller/tune/runner.py) starts this module as a subprocess, so a candidate
that crashes or hangs takes down only this process, and the pod's simulated device count can be
set before jax initialises. The controller never imports it: they speak a line protocol.

stdin, one JSON line:
    {"devices": N (0: the devices jax finds), "per_pod_batch": rows, "steps": timed steps,
     "memory_limit": bytes or null, "forward": true to also time the forward pass alone (optional),
     "candidates": [[index, WorkerConfig JSON], ...]}
stdout, one JSON object per line (other lines are ignored by the reader):
    {"event": "ready", "device_kind": ..., "num_devices": ...}
    {"event": "start", "index": i}              before candidate i is built
    {"event": "result", "index": i, "status": "ok" | "over memory limit" | "error", ...}
    {"event": "done"}

Each candidate is built as the worker builds it (PodTrainer from its WorkerConfig), compiled once
for the pod's shard, and its compiled per-device memory read from XLA. Over the memory limit it is
not run; otherwise the trainer's own step (PodTrainer.train_step) runs steps + 1 times, the first
as warm-up, and the median of the rest is the step time. With "forward", the forward pass alone
(the trainer's evaluation program on the same batch) is timed the same way: `forward_s`
(`multipod tune --dcn` splits the compute into forward and backward with it).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from multipod.pod_worker.devices import simulate_cpu_devices


def emit(**fields) -> None:
    """Write one protocol message to stdout."""
    print(json.dumps(fields), flush=True)


def random_tokens(vocab_size: int, rows: int, seq_len: int):
    """A fixed batch of token ids [rows, seq_len + 1] (the timings do not depend on the values), in
    the dtype a worker receives: uint8 for a vocabulary of at most 256 ids (the trainer widens it
    on the devices, as in a run)."""
    import numpy as np
    dtype = np.uint8 if vocab_size <= 256 else np.int32
    return np.random.RandomState(0).randint(0, vocab_size, size=(rows, seq_len + 1)).astype(dtype)


def probe(worker_json: str, devices: list, rows: int, steps: int, memory_limit: int | None,
          forward: bool = False) -> dict:
    """Build, compile and time one layout; a result dict (status, memory, step times), or raises.

    devices: the jax devices of the pod; rows: the pod's batch in sequences."""
    from multipod.pod_worker import programs
    from multipod.pod_worker.schema import WorkerConfig
    from multipod.pod_worker.trainer import PodTrainer

    config = WorkerConfig.from_json(worker_json)
    programs.check_microbatches(rows, config.model.microbatches)  # fail before building anything
    tokens = random_tokens(config.model.vocab_size, rows, config.train.seq_len)
    global_tokens = config.train.global_batch * config.train.seq_len
    result: dict = {}
    start = time.perf_counter()
    trainer = PodTrainer(config, devices=devices)
    trainer.compile_for(tokens.shape)
    result["compile_s"] = time.perf_counter() - start
    stats = trainer.compiled_stats()
    result.update(stats)
    peaks = [b for b in (stats["peak_bytes"], stats["update_peak_bytes"]) if b is not None]
    result["memory_bytes"] = max(peaks) if peaks else None
    if memory_limit and result["memory_bytes"] is not None and result["memory_bytes"] > memory_limit:
        result["status"] = "over memory limit"
        return result
    batch = trainer.put_batch(tokens)
    times, parts = [], {"compute_s": [], "update_s": [], "checksum_s": []}
    for step in range(steps + 1):  # the first run is warm-up, not timed
        t0 = time.perf_counter()
        outcome = trainer.train_step(batch, global_tokens)  # returns host values: the step is finished
        elapsed = time.perf_counter() - t0
        if step:
            times.append(elapsed)
            for name, values in parts.items():
                values.append(getattr(outcome, name))
    result["step_times_s"] = times
    result["step_time_s"] = statistics.median(times)
    result["step_parts_s"] = {name: statistics.median(values) for name, values in parts.items()}
    if forward:
        forward_times = []
        for step in range(steps + 1):   # the first compiles the evaluation program: not timed
            t0 = time.perf_counter()
            trainer.evaluate(tokens)    # returns a host value: the pass is finished
            if step:
                forward_times.append(time.perf_counter() - t0)
        result["forward_s"] = statistics.median(forward_times)
    result["status"] = "ok"
    return result


def serve(measure) -> int:
    """The probe's side of the line protocol, for this probe and the inference probe: read the spec
    from stdin, set the pod's device count, then measure(candidate, devices, spec) every candidate
    in order (a dict, or raises: the error is the candidate's row) and report each on stdout."""
    spec = json.loads(sys.stdin.readline())
    if spec["devices"]:
        simulate_cpu_devices(spec["devices"])  # before jax initialises
    import jax

    devices = jax.devices()[:spec["devices"] or None]
    emit(event="ready", device_kind=devices[0].device_kind, num_devices=len(devices))
    for index, candidate in spec["candidates"]:
        emit(event="start", index=index)
        try:
            result = measure(candidate, devices, spec)
        except Exception as exc:  # noqa: BLE001 -- every failure is a row of the table
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
        emit(event="result", index=index, **result)
    emit(event="done")
    return 0


def main() -> int:
    """Read the spec from stdin, probe every candidate in order, report each on stdout."""
    return serve(lambda worker_json, devices, spec: probe(worker_json, devices, spec["per_pod_batch"], spec["steps"],
                                                          spec["memory_limit"], bool(spec.get("forward"))))


if __name__ == "__main__":
    sys.exit(main())
