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
import math
import pathlib
import queue
import statistics
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from multipod import protos
from multipod.controller import faults
from multipod.controller.client import WorkerClient, WorkerError
from multipod.controller.config import Config, ConfigError
from multipod.controller.data import Batches, decode_tokens, encode_text, load_corpus, shard
from multipod.controller.metrics import MetricsLog, ProgressLine, load_measured_peak, mfu, out
from multipod.protos import codec, multipod_pb2 as pb


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


class PodFailure(RunError):
    """A pod died, hung or failed a step: recoverable by restoring every pod to the last
    checkpoint. `pods` are the pods found unresponsive (empty if none could be singled out)."""

    def __init__(self, message: str, pods=(), hung=()):
        super().__init__(message)
        self.pods = tuple(pods)
        self.hung = tuple(hung)   # alive but not answering (a dead pod's check is refused at once)


class _Spike(Exception):
    def __init__(self, step: int, loss: float, mean: float):
        super().__init__(f"step {step}: loss {loss:.4f} is a spike (recent mean {mean:.4f})")
        self.step, self.loss, self.mean = step, loss, mean


HUNG = "no answer"   # how WorkerClient.probe's verdict on a hung (alive, silent) worker begins


class _Watchdog:
    """Probes every pod's standard gRPC health service on a background thread; a pod that
    misses `misses` checks in a row (each with its own deadline) is reported by name."""

    def __init__(self, clients: list[WorkerClient], interval_s: float, timeout_s: float, misses: int = 2):
        self.clients, self.interval_s, self.timeout_s, self.misses = clients, interval_s, timeout_s, misses
        self.failure: PodFailure | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="watchdog")
        self._thread.start()

    def _run(self):
        missed = [0] * len(self.clients)
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            while not self._stop.wait(self.interval_s):
                verdicts = list(pool.map(lambda c: c.probe(self.timeout_s), self.clients))
                if self._stop.is_set():
                    return
                for i, why in enumerate(verdicts):
                    missed[i] = missed[i] + 1 if why else 0
                bad = [i for i in range(len(self.clients)) if missed[i] >= self.misses]
                if bad:
                    self.failure = PodFailure("; ".join(
                        f"{self.clients[i].name} is not responding: {verdicts[i]}" for i in bad), bad,
                        [i for i in bad if verdicts[i].startswith(HUNG)])
                    return

    def stop(self):
        self._stop.set()


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


def configure(clients: list[WorkerClient], config: Config, run_id: str,
              only: list[int] | None = None) -> list[pb.ConfigureReply]:
    """Configure every pod (or the pods in `only`, e.g. restarted ones) and refuse pods that
    disagree on protocol, mesh, config or state."""
    addresses = [c.address for c in clients]
    targets = [c for c in clients if only is None or c.pod_index in only]
    request = lambda c: pb.ConfigureRequest(
        protocol_version=protos.PROTOCOL_VERSION, pod_index=c.pod_index, num_pods=len(clients),
        peer_addresses=addresses, worker_config_json=config.worker_config().to_json(), run_id=run_id)
    replies = _parallel(lambda c: c.call("Configure", request(c), config.run.configure_timeout_s), targets)
    checks = [("protocol version", lambda r: r.protocol_version), ("mesh shape (data, model)", lambda r: tuple(r.mesh_shape)),
              ("device count", lambda r: r.num_devices), ("config hash", lambda r: r.config_hash),
              ("initial state fingerprint", lambda r: r.fingerprint)]
    for what, get in checks:
        values = [get(r) for r in replies]
        if len(set(values)) > 1:
            detail = ", ".join(f"{c.name} has {v}" for c, v in zip(targets, values))
            raise RunError(f"pods disagree on {what}: {detail}. Every pod must run the same "
                           f"multipod version with the same device count and mesh.")
    data_axis = replies[0].mesh_shape[0]
    per_pod = config.data.global_batch // len(clients)
    if per_pod % data_axis:
        raise ConfigError("data.global_batch", f"{config.data.global_batch} split over {len(clients)} pods gives "
                          f"{per_pod} rows per pod, not a multiple of the data axis ({data_axis})")
    return replies


class _Prefetcher:
    """Builds the encoded shards of upcoming steps on a background thread. Step s trains on
    batch s + offset (the offset grows when a loss-spike rewind skips batches)."""

    def __init__(self, batches: Batches, num_pods: int, start: int, stop: int, depth: int = 4, offset: int = 0):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, num_pods, start, stop, offset), daemon=True)
        self._thread.start()

    def _run(self, batches, num_pods, start, stop, offset):
        for step in range(start, stop):
            shards = [codec.encode(s) for s in shard(batches.batch(step + offset), num_pods)]
            while not self._stop.is_set():
                try:
                    self._queue.put((step, shards), timeout=0.5)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set():
                return

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


def _record(step, replies, step_time, config: Config, peak, num_devices, hw_flops_per_step: float = 0.0) -> dict:
    tokens = sum(r.tokens for r in replies)
    loss = sum(r.loss_sum for r in replies) / tokens
    tokens_per_s = tokens / step_time if step_time > 0 else 0.0
    flops_per_token = config.model.flops_per_token(config.data.seq_len)
    # Hardware FLOPs (XLA's count of what the pods' compiled steps execute, recompute included).
    hw_per_token = hw_flops_per_step / tokens if hw_flops_per_step and tokens else None
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
        "hardware_flops_per_token": hw_per_token,
        "hfu": mfu(tokens_per_s, hw_per_token, peak, num_devices) if hw_per_token else None,
        "time": time.time(),
    }


def run_training(config: Config, addresses: list[str], run_dir: pathlib.Path,
                 progress: ProgressLine | None = None, resume: bool = False, supervisor=None) -> Summary:
    """Train for config.run.steps steps on the pods at `addresses`; returns the run summary.

    resume: continue from the newest checkpoint in the checkpoint directory. supervisor: an
    object with kill(pod) that gets a hung pod restarted (LocalPods); without one, the controller
    waits for the user's supervisor to bring a failed worker back."""
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
        batches = Batches(tokens, config.data.seq_len, config.data.global_batch, config.run.seed)
        return _Session(config, clients, run_dir, batches, progress, resume, supervisor).run()
    finally:
        for c in clients:
            c.close()


def checkpoint_dir(config: Config, run_dir: pathlib.Path) -> str:
    """Where the run's checkpoints go (absolute: the workers may run in another directory)."""
    return str(pathlib.Path(config.run.checkpoint_dir or run_dir / "checkpoints").absolute())


class _Session:
    """One training run: the pipelined step loop, checkpoints, and recovery from failed pods."""

    def __init__(self, config: Config, clients: list[WorkerClient], run_dir: pathlib.Path, batches: Batches,
                 progress, resume: bool, supervisor):
        self.config, self.clients, self.run_dir, self.batches = config, clients, run_dir, batches
        self.progress_arg, self.resume, self.supervisor = progress, resume, supervisor
        self.rc = config.run
        self.base_run_id = uuid.uuid4().hex
        self.generation = 0
        self.ckpt_dir = checkpoint_dir(config, run_dir)
        self.last_good: tuple[int, str] | None = None     # (step, path) of the newest confirmed checkpoint
        self.pending_saves: list[tuple[int, str, object]] = []
        self.failed_saves = 0
        self.data_offset = 0
        self.records: dict[int, dict] = {}
        self.restarts = 0
        self.rewinds = 0
        self.skipped_steps: set[int] = set()
        self.losses: collections.deque = collections.deque(maxlen=config.run.spike_window)
        self.events = (run_dir / "events.jsonl").open("a")

    @property
    def run_id(self) -> str:
        return f"{self.base_run_id}.{self.generation}"

    def event(self, kind: str, **fields) -> None:
        """A line in events.jsonl: checkpoints, failures, restarts, rewinds."""
        self.events.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")
        self.events.flush()

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> Summary:
        config, clients = self.config, self.clients
        out(f"configuring {len(clients)} pod(s): compiling the step (this takes a while the first time)")
        replies = configure(clients, config, self.run_id)
        r0 = replies[0]
        self.num_devices = sum(r.num_devices for r in replies)
        self.peak = config.run.peak_flops or load_measured_peak(r0.device_kind, self.num_devices)
        self.hw_flops_per_step = sum(r.hardware_flops_per_step for r in replies)
        if r0.memory_peak_bytes:
            out(f"compiled step: {r0.memory_peak_bytes / 2**20:.1f} MiB per device (temporaries "
                f"{r0.memory_temp_bytes / 2**20:.1f} MiB); {self.hw_flops_per_step / 1e9:.2f} hardware GFLOP per step")
        out(f"{len(clients)} pod(s) x {r0.num_devices} {r0.device_kind} device(s), mesh data={r0.mesh_shape[0]} "
            f"model={r0.mesh_shape[1]}; {r0.param_count:,} parameters; "
            f"{config.model.flops_per_token(config.data.seq_len) / 1e6:.1f} MFLOP/token; peak "
            + (f"{self.peak / 1e9:.1f} GFLOP/s per device" if self.peak else "unknown (MFU not reported; see `multipod peak-flops`)"))
        if self.resume:
            start = self._restore(directory=self.ckpt_dir)
            out(f"resumed from {self.last_good[1]} (step {start}, data position {start + self.data_offset})")
            if start > self.rc.steps:
                raise ConfigError("run.steps", f"{self.rc.steps} is behind the checkpoint's step {start}; "
                                  f"resume with --steps {start} or more")
        else:
            start = int(r0.step)
            self._save(start)      # a baseline to recover to before the first periodic checkpoint
        self.metrics = MetricsLog(self.run_dir, append=self.resume)
        self.progress = self.progress_arg or ProgressLine(self.rc.steps, start)
        try:
            while True:
                try:
                    self._segment(start)
                    self._finish_saves(block=True)
                    break
                except PodFailure as exc:
                    start = self._recover(exc)
                except _Spike as spike:
                    start = self._rewind(spike)
        finally:
            self.progress.close()
            self.metrics.close()
            self._finish_saves(block=False)
            self.events.close()
        records = [self.records[s] for s in sorted(self.records)]
        return _finish(config, clients, self.run_dir, self.batches, records, extra=self._summary_extra())

    def _summary_extra(self) -> dict:
        return {"skipped_steps": len(self.skipped_steps), "restarts": self.restarts, "rewinds": self.rewinds,
                "failed_checkpoints": self.failed_saves,
                "last_checkpoint": self.last_good[1] if self.last_good else None}

    def _segment(self, start: int) -> None:
        """Steps start..run.steps, pipelined; checkpoints at their boundaries and at the end."""
        run, steps = self.rc, self.rc.steps
        global_tokens = self.config.data.global_batch * self.config.data.seq_len
        prefetch = _Prefetcher(self.batches, len(self.clients), start, steps, offset=self.data_offset)
        watchdog = _Watchdog(self.clients, run.health_interval_s, run.health_timeout_s)
        pending: collections.deque = collections.deque()
        self.last_done = time.perf_counter()
        self.last_progress = time.monotonic()
        try:
            try:
                self._steps(start, steps, prefetch, watchdog, pending, global_tokens)
            except _Spike:
                # Let the steps in flight finish (their pods are healthy) before the rewind
                # restores every pod; their results belong to the abandoned timeline.
                for _, calls in pending:
                    for call in calls:
                        call.wait(run.step_timeout_s)
                pending.clear()
                raise
        finally:
            for _, calls in pending:
                for call in calls:
                    call.cancel()
            prefetch.close()
            watchdog.stop()

    def _steps(self, start, steps, prefetch, watchdog, pending, global_tokens) -> None:
        run = self.rc
        for step in range(start, steps):
            if step > start and run.checkpoint_every and step % run.checkpoint_every == 0:
                while pending:     # the checkpoint must hold exactly the state after step-1
                    self._complete(pending.popleft(), watchdog)
                self._save(step)
            got_step, shards = prefetch.next()
            assert got_step == step
            calls = [c.call_async("Step", pb.StepRequest(step=step, tokens=s, global_tokens=global_tokens),
                                  run.step_timeout_s) for c, s in zip(self.clients, shards)]
            pending.append((step, calls))
            while len(pending) >= run.dispatch_depth or (pending and step == steps - 1):
                self._complete(pending.popleft(), watchdog)
            self._finish_saves(block=False)
        saved = {s for s, _, _ in self.pending_saves} | ({self.last_good[0]} if self.last_good else set())
        if steps not in saved:    # and always one at the end
            self._save(steps)

    def _complete(self, item, watchdog: _Watchdog) -> None:
        """Wait for one step's replies (watching the pods meanwhile), check and record it."""
        step, calls = item
        progress_timeout = self.rc.progress_timeout_s or self.rc.step_timeout_s
        results, errors = [], []
        for call in calls:
            while not call.wait(0.2):
                if watchdog.failure is not None:
                    raise watchdog.failure
                if time.monotonic() - self.last_progress > progress_timeout:
                    raise self._diagnose(f"step {step}: no step finished for {progress_timeout:g}s")
            try:
                results.append(call.result())
            except WorkerError as exc:
                errors.append(exc)
        if errors:
            # The root cause first: a pod that failed outright, not its peers' timeouts.
            errors.sort(key=lambda e: e.code is not None and e.code.name in ("ABORTED", "UNAVAILABLE"))
            raise self._diagnose(f"step {step} failed: " + "; ".join(str(e) for e in errors))
        _check_step(step, self.clients, results)
        now = time.perf_counter()
        record = _record(step, results, now - self.last_done, self.config, self.peak, self.num_devices,
                         self.hw_flops_per_step)
        self.last_done, self.last_progress = now, time.monotonic()
        if record["skipped"]:
            self.skipped_steps.add(step)
        record.update(skipped_steps=len(self.skipped_steps), restarts=self.restarts,
                      data_index=step + self.data_offset)
        if record["data_index"] == faults.spike_batch():
            record["loss"] *= faults.SPIKE_FACTOR    # test hook: this batch "causes" a loss spike
        self.metrics.write(record)
        self.records[step] = record
        self.progress.update(record)
        self._check_spike(step, record)

    def _check_spike(self, step: int, record: dict) -> None:
        loss = record["loss"]
        if record["skipped"] or not math.isfinite(loss):
            return
        if self.rc.on_spike == "rewind" and len(self.losses) == self.losses.maxlen:
            mean = sum(self.losses) / len(self.losses)
            if loss > self.rc.spike_threshold * mean:
                raise _Spike(step, loss, mean)
        self.losses.append(loss)

    def _diagnose(self, message: str) -> PodFailure:
        """Probe every pod's health (each with a deadline) and name the ones that do not answer."""
        verdicts = _parallel(lambda c: c.probe(self.rc.health_timeout_s), self.clients)
        bad = [i for i, why in enumerate(verdicts) if why]
        if bad:
            message = "; ".join(f"{self.clients[i].name} is not responding: {verdicts[i]}" for i in bad) + \
                f" ({message})"
        return PodFailure(message, bad, [i for i in bad if verdicts[i].startswith(HUNG)])

    # -- checkpoints -------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        """Start an asynchronous checkpoint of the state after `step` steps on pod 0 (every
        pod's state is identical); its outcome is collected by _finish_saves."""
        meta = {"data_offset": self.data_offset, "data_position": step + self.data_offset,
                "data_path": self.config.data.path,
                "seed": self.rc.seed, "run_id": self.base_run_id, "num_pods": len(self.clients),
                "saved_at": time.time()}
        request = pb.SaveRequest(step=step, directory=self.ckpt_dir, metadata_json=json.dumps(meta),
                                 background=True, keep=self.rc.keep_checkpoints)
        try:
            reply = self.clients[0].call("Save", request, self.rc.step_timeout_s)
        except WorkerError as exc:
            if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise self._diagnose(f"checkpoint of step {step}: {exc}") from None
            self._save_failed(step, str(exc))
            return
        wait = self.clients[0].call_async("WaitSave", pb.WaitSaveRequest(step=step, directory=self.ckpt_dir),
                                          CHECKPOINT_TIMEOUT_S)
        self.pending_saves.append((step, reply.path, wait))
        self.event("checkpoint_started", step=step, path=reply.path)

    def _save_failed(self, step: int, why: str) -> None:
        self.failed_saves += 1
        last = f"{self.last_good[1]} (step {self.last_good[0]})" if self.last_good else "none yet"
        out(f"ERROR: checkpoint of step {step} FAILED: {why}. The last good checkpoint is still {last}.")
        self.event("checkpoint_failed", step=step, error=why)

    def _finish_saves(self, block: bool) -> None:
        """Collect finished background saves (all of them if block): a success becomes the
        last good checkpoint, a failure is reported at once."""
        still = []
        for step, path, call in self.pending_saves:
            if not block and not call.done():
                still.append((step, path, call))
                continue
            try:
                reply = call.result()
            except WorkerError as exc:
                self._save_failed(step, str(exc))
                continue
            if self.last_good is None or step >= self.last_good[0]:
                self.last_good = (step, reply.path or path)
            self.event("checkpoint_saved", step=step, path=reply.path or path)
        self.pending_saves = still

    def _restore(self, directory: str | None = None) -> int:
        """Restore every pod to the newest checkpoint in `directory` (resume) or to the last good
        checkpoint; returns its step. The pods' DCN links start afresh under a new run id."""
        self.generation += 1
        timeout = self.rc.step_timeout_s + self.config.dcn.timeout_s + 60.0
        if directory is not None:
            first = self.clients[0].call("Restore", pb.RestoreRequest(directory=directory, run_id=self.run_id), timeout)
            path = first.path
            rest = self.clients[1:]
        else:
            path = self.last_good[1]
            rest, first = self.clients, None
        replies = _parallel(lambda c: c.call("Restore", pb.RestoreRequest(path=path, run_id=self.run_id), timeout), rest)
        replies = ([first] if first is not None else []) + replies
        prints = {r.fingerprint for r in replies}
        if len(prints) > 1:
            raise RunError(f"pods restored {path} to different states: " +
                           ", ".join(f"{c.name}: {r.fingerprint}" for c, r in zip(self.clients, replies)))
        meta = json.loads(replies[0].metadata_json)
        step = int(replies[0].step)
        if directory is not None:
            if meta.get("data_path", "") != self.config.data.path:
                raise ConfigError("data.path", f"checkpoint {path} was trained on {meta.get('data_path') or 'the default corpus'!r}, "
                                  f"this run reads {self.config.data.path or 'the default corpus'!r}")
            self.data_offset = int(meta.get("data_offset", 0))
        self.last_good = (step, path)
        self.event("restored", step=step, path=path, data_offset=self.data_offset, fingerprint=replies[0].fingerprint)
        return step

    # -- recovery ----------------------------------------------------------------------------
    def _recover(self, failure: PodFailure) -> int:
        """Bring every pod back to the last good checkpoint after a pod failed; returns the step
        to continue from. RunError once run.max_restarts recoveries have been used."""
        out(f"pod failure: {failure}")
        self.event("pod_failure", error=str(failure), pods=list(failure.pods))
        self._finish_saves(block=False)
        last = f"{self.last_good[1]} (step {self.last_good[0]})" if self.last_good else "none"
        if self.restarts >= self.rc.max_restarts:
            raise RunError(f"{failure}. Giving up after {self.restarts} restart(s) (--max-restarts "
                           f"{self.rc.max_restarts}); the last good checkpoint is {last}: continue with --resume")
        self.restarts += 1
        if self.supervisor is not None:
            # A hung worker is killed so that the supervisor restarts it; a dead one is already
            # being restarted (killing it now could hit its new incarnation).
            for pod in failure.hung:
                self.supervisor.kill(pod)
        out(f"recovery {self.restarts}/{self.rc.max_restarts}: waiting up to {self.rc.restart_timeout_s:g}s "
            f"for every pod to serve, then restoring {last}")
        try:
            _parallel(lambda c: c.wait_serving(self.rc.restart_timeout_s), self.clients)
            statuses = _parallel(lambda c: c.status(self.rc.health_timeout_s), self.clients)
            fresh = [c.pod_index for c, s in zip(self.clients, statuses) if not s.configured]
            if fresh:
                out(f"configuring restarted pod(s) {fresh}")
                configure(self.clients, self.config, self.run_id, only=fresh)
            self._finish_saves(block=True)
            if self.last_good is None:
                raise RunError(f"{failure}; no checkpoint to recover from")
            step = self._restore()
        except (WorkerError, RunError) as exc:
            raise RunError(f"recovery from ({failure}) failed: {exc}; the last good checkpoint is {last}") from None
        out(f"recovered: every pod restored to step {step}; continuing")
        self.event("recovered", step=step, restarts=self.restarts)
        self.losses.clear()
        return step

    def _rewind(self, spike: _Spike) -> int:
        """Loss spike: restore the checkpoint from before it and skip the next skip_batches batches."""
        self._finish_saves(block=True)
        if self.rewinds >= max(1, self.rc.max_restarts):
            raise RunError(f"{spike}; loss spikes persist after {self.rewinds} rewind(s)")
        if self.last_good is None or self.last_good[0] > spike.step:
            raise RunError(f"{spike}; no checkpoint from before it to rewind to")
        self.rewinds += 1
        self.data_offset += self.rc.skip_batches
        step = self._restore()
        out(f"loss spike at {spike}: rewound to step {step}, skipping {self.rc.skip_batches} batch(es) "
            f"(step {step} now trains on batch {step + self.data_offset})")
        self.event("rewind", spike_step=spike.step, loss=spike.loss, mean=spike.mean, to_step=step,
                   data_offset=self.data_offset)
        self.losses.clear()
        return step


CHECKPOINT_TIMEOUT_S = 3600.0   # deadline of the wait for one background checkpoint write


def _finish(config: Config, clients, run_dir: pathlib.Path, batches: Batches, records: list[dict],
            extra: dict | None = None) -> Summary:
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
    (run_dir / "summary.json").write_text(json.dumps({**summary.__dict__, **(extra or {})}, indent=2) + "\n")
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
