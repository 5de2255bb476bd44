"""The controller's step loop: data -> global batch -> one shard per pod -> parallel dispatch.

Step RPCs are pipelined `run.dispatch_depth` deep: the shards of step s+1 are on the wire (and on
the pods' devices) while step s computes, so the controller stays off the critical path. After
every step the pods' fingerprints are compared; any difference stops the run, naming the step and
the pods.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import pathlib
import queue
import statistics
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

import protos
from controller.client import WorkerClient, WorkerError
from controller.config import Config, ConfigError
from controller.data import Batches, decode_tokens, encode_text, load_corpus, shard
from controller.metrics import MetricsLog, ProgressLine, load_measured_peak, mfu, out
from protos import codec, multipod_pb2 as pb


class RunError(RuntimeError):
    """The run cannot go on; the message says why and names the pods and step involved."""


@dataclass
class Summary:
    steps: int
    first_loss: float
    final_loss: float
    eval_loss: float | None
    fingerprint: str
    median_step_time_s: float
    median_tokens_per_s: float
    median_mfu: float | None
    sample: str | None
    run_dir: str


def _parallel(fn, items):
    """Run fn over items in threads; return results in order, raising the first error."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        errors = []
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:
                errors.append(exc)
        if errors:
            if len(errors) == 1:
                raise errors[0]
            raise RunError("; ".join(str(e) for e in errors))
        return results


def connect(addresses: list[str], timeout_s: float) -> list[WorkerClient]:
    """Clients for every pod, each checked for readiness within the deadline."""
    clients = [WorkerClient(i, a) for i, a in enumerate(addresses)]
    try:
        _parallel(lambda c: c.wait_ready(timeout_s), clients)
    except Exception:
        for c in clients:
            c.close()
        raise
    return clients


def configure(clients: list[WorkerClient], config: Config, run_id: str) -> list[pb.ConfigureReply]:
    """Configure every pod and refuse pods that disagree on protocol, mesh, config or state."""
    addresses = [c.address for c in clients]
    request = lambda c: pb.ConfigureRequest(
        protocol_version=protos.PROTOCOL_VERSION, pod_index=c.pod_index, num_pods=len(clients),
        peer_addresses=addresses, config_json=config.to_json(), run_id=run_id)
    replies = _parallel(lambda c: c.call("Configure", request(c), config.run.configure_timeout_s), clients)
    checks = [("protocol version", lambda r: r.protocol_version), ("mesh shape (data, model)", lambda r: tuple(r.mesh_shape)),
              ("device count", lambda r: r.num_devices), ("config hash", lambda r: r.config_hash),
              ("initial state fingerprint", lambda r: r.fingerprint)]
    for what, get in checks:
        values = [get(r) for r in replies]
        if len(set(values)) > 1:
            detail = ", ".join(f"{c.name} has {v}" for c, v in zip(clients, values))
            raise RunError(f"pods disagree on {what}: {detail}. Every pod must run the same "
                           f"multipod version with the same device count and mesh.")
    data_axis = replies[0].mesh_shape[0]
    per_pod = config.data.global_batch // len(clients)
    if per_pod % data_axis:
        raise ConfigError("data.global_batch", f"{config.data.global_batch} split over {len(clients)} pods gives "
                          f"{per_pod} rows per pod, not a multiple of the data axis ({data_axis})")
    return replies


class _Prefetcher:
    """Builds the encoded shards of upcoming steps on a background thread."""

    def __init__(self, batches: Batches, num_pods: int, start: int, stop: int, depth: int = 4):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, num_pods, start, stop), daemon=True)
        self._thread.start()

    def _run(self, batches, num_pods, start, stop):
        for step in range(start, stop):
            shards = [codec.encode(s) for s in shard(batches.batch(step), num_pods)]
            while not self._stop.is_set():
                try:
                    self._queue.put((step, shards), timeout=0.5)
                    break
                except queue.Full:
                    continue

    def next(self, timeout_s: float = 60.0):
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise RunError(f"the data pipeline produced no batch within {timeout_s:g}s") from None

    def close(self):
        self._stop.set()


def _check_step(step: int, clients: list[WorkerClient], replies: list[pb.StepReply]) -> None:
    prints = [r.fingerprint for r in replies]
    if len(set(prints)) > 1:
        detail = ", ".join(f"{c.name}: {p}" for c, p in zip(clients, prints))
        raise RunError(f"step {step}: pods diverged, their parameter fingerprints differ ({detail})")
    skipped = {r.skipped for r in replies}
    if len(skipped) > 1:
        raise RunError(f"step {step}: pods disagree on skipping the update")


def _record(step, replies, step_time, config: Config, peak, num_devices) -> dict:
    tokens = sum(r.tokens for r in replies)
    loss = sum(r.loss_sum for r in replies) / tokens
    tokens_per_s = tokens / step_time if step_time > 0 else 0.0
    flops_per_token = config.model.flops_per_token(config.data.seq_len)
    return {
        "step": step, "loss": loss, "z_loss": sum(r.z_loss_sum for r in replies) / tokens,
        "grad_norm": replies[0].grad_norm, "learning_rate": replies[0].learning_rate,
        "skipped": replies[0].skipped, "fingerprints": [r.fingerprint for r in replies],
        "step_time_s": step_time,
        "compute_time_s": max(r.timings.compute_s for r in replies),
        "exchange_time_s": max(r.timings.exchange_s for r in replies),
        "update_time_s": max(r.timings.update_s for r in replies),
        "pods": [{"compute_s": r.timings.compute_s, "exchange_s": r.timings.exchange_s,
                  "update_s": r.timings.update_s, "wait_s": r.timings.wait_s,
                  "fingerprint_s": r.timings.fingerprint_s, "idle_s": r.timings.idle_s,
                  "dcn_bytes_sent": r.dcn_bytes_sent} for r in replies],
        "dcn_bytes_sent": sum(r.dcn_bytes_sent for r in replies),
        "tokens": tokens, "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops_per_token,
        "mfu": mfu(tokens_per_s, flops_per_token, peak, num_devices),
        "time": time.time(),
    }


def run_training(config: Config, addresses: list[str], run_dir: pathlib.Path,
                 progress: ProgressLine | None = None) -> Summary:
    """Train for config.run.steps steps on the pods at `addresses`; returns the run summary."""
    if not addresses:
        raise ConfigError("--workers", "no worker addresses given")
    num_pods = len(addresses)
    if config.data.global_batch % num_pods:
        raise ConfigError("data.global_batch", f"{config.data.global_batch} does not split over {num_pods} pods")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")

    # Load the corpus while the workers get ready.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        corpus = pool.submit(load_corpus, config.data.path)
        clients = connect(addresses, config.run.connect_timeout_s)
        tokens = corpus.result()
    try:
        return _train(config, clients, run_dir, Batches(tokens, config.data.seq_len, config.data.global_batch,
                                                        config.run.seed), progress)
    finally:
        for c in clients:
            c.close()


def _train(config, clients, run_dir, batches, progress) -> Summary:
    run_id = uuid.uuid4().hex
    out(f"configuring {len(clients)} pod(s): compiling the step (this takes a while the first time)")
    replies = configure(clients, config, run_id)
    r0 = replies[0]
    num_devices = sum(r.num_devices for r in replies)
    peak = config.run.peak_flops or load_measured_peak(r0.device_kind, num_devices)
    out(f"{len(clients)} pod(s) x {r0.num_devices} {r0.device_kind} device(s), mesh data={r0.mesh_shape[0]} "
        f"model={r0.mesh_shape[1]}; {r0.param_count:,} parameters; "
        f"{config.model.flops_per_token(config.data.seq_len) / 1e6:.1f} MFLOP/token; peak "
        + (f"{peak / 1e9:.1f} GFLOP/s per device" if peak else "unknown (MFU not reported; see `multipod peak-flops`)"))
    steps = config.run.steps
    start = int(r0.step)
    global_tokens = config.data.global_batch * config.data.seq_len
    metrics = MetricsLog(run_dir)
    progress = progress or ProgressLine(steps, start)
    prefetch = _Prefetcher(batches, len(clients), start, steps)
    records = []
    pending: collections.deque = collections.deque()
    last_done = time.perf_counter()
    try:
        for step in range(start, steps):
            got_step, shards = prefetch.next()
            assert got_step == step
            calls = [c.call_async("Step", pb.StepRequest(step=step, tokens=s, global_tokens=global_tokens),
                                  config.run.step_timeout_s) for c, s in zip(clients, shards)]
            pending.append((step, calls))
            while len(pending) >= config.run.dispatch_depth or (pending and step == steps - 1):
                done_step, done_calls = pending.popleft()
                step_replies = _gather(done_calls, pending)
                _check_step(done_step, clients, step_replies)
                now = time.perf_counter()
                record = _record(done_step, step_replies, now - last_done, config, peak, num_devices)
                last_done = now
                metrics.write(record)
                records.append(record)
                progress.update(record)
    finally:
        for _, calls in pending:
            for call in calls:
                call.cancel()
        prefetch.close()
        progress.close()
        metrics.close()
    return _finish(config, clients, run_dir, batches, records)


def _gather(calls, pending) -> list[pb.StepReply]:
    results, errors = [], []
    for call in calls:
        try:
            results.append(call.result())
        except WorkerError as exc:
            errors.append(exc)
    if errors:
        # Report the root cause first: a pod that failed outright, not its peers' timeouts.
        errors.sort(key=lambda e: e.code is not None and e.code.name in ("ABORTED", "UNAVAILABLE"))
        raise RunError("; ".join(str(e) for e in errors))
    return results


def _finish(config: Config, clients, run_dir: pathlib.Path, batches: Batches, records: list[dict]) -> Summary:
    eval_loss = None
    if config.run.eval_batches:
        total, count = 0.0, 0
        for index in range(config.run.eval_batches):
            reply = clients[0].call("Evaluate", pb.EvaluateRequest(tokens=codec.encode(batches.eval_batch(index))),
                                    config.run.step_timeout_s)
            total, count = total + reply.loss_sum, count + reply.tokens
        eval_loss = total / count
    sample = None
    if config.run.sample_tokens:
        prompt = encode_text(config.run.sample_prompt or " ")
        reply = clients[0].call("Generate", pb.GenerateRequest(
            prompt=codec.encode(prompt), num_tokens=config.run.sample_tokens, temperature=0.7,
            seed=config.run.seed), config.run.step_timeout_s)
        sample = config.run.sample_prompt + decode_tokens(codec.decode(reply.tokens))
    timed = records[1:] or records   # the first step includes warm-up
    mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
    summary = Summary(
        steps=len(records), first_loss=records[0]["loss"] if records else float("nan"),
        final_loss=records[-1]["loss"] if records else float("nan"), eval_loss=eval_loss,
        fingerprint=records[-1]["fingerprints"][0] if records else "",
        median_step_time_s=statistics.median(r["step_time_s"] for r in timed) if timed else 0.0,
        median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed) if timed else 0.0,
        median_mfu=statistics.median(mfus) if mfus else None, sample=sample, run_dir=str(run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2) + "\n")
    return summary


def print_summary(summary: Summary) -> None:
    mfu_text = f"{summary.median_mfu:.1%}" if summary.median_mfu is not None else "n/a (no peak FLOP/s known)"
    out("")
    out(f"done: {summary.steps} steps, loss {summary.first_loss:.4f} -> {summary.final_loss:.4f}"
        + (f", held-out loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else ""))
    out(f"median step {summary.median_step_time_s:.3f}s, {summary.median_tokens_per_s:,.0f} tokens/s, MFU {mfu_text}")
    out(f"final parameter fingerprint {summary.fingerprint} (identical on every pod)")
    out(f"run directory: {summary.run_dir}")
    if summary.sample is not None:
        out("sample:\n" + "-" * 60 + "\n" + summary.sample + "\n" + "-" * 60)
