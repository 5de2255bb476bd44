"""In-process fake pods for the controller's unit tests: no gRPC server, no jax computation.

A FakePod has the part of the PodApi interface (controller/cluster/api.py) the step loop and the
cluster use (name, pod_index, address, probe, configure, step_async, status, wait_serving, close).
Its Step answers from an `on_step` function of (pod, step, data index); a behaviour can raise a
WorkerError or hang (never finish)."""
from __future__ import annotations

import dataclasses
import threading

import grpc
import numpy as np

from multipod import protos
from multipod.controller.cluster.client import Probe, Verdict, WorkerError
from multipod.controller.core.run_config import Config, DataConfig
from multipod.controller.observe.records import PodTimings, StepRecord
from multipod.model.config import ModelConfig
from multipod.protos import codec, multipod_pb2 as pb

SERVING = Probe(Verdict.SERVING)
HUNG = Probe(Verdict.HUNG, "no answer to its health check within 0.05s (hung or overloaded)")
DEAD = Probe(Verdict.DEAD, "health check failed: UNAVAILABLE (dead or restarting)")
HANG = object()     # a step behaviour: the call never finishes


# The fakes' config: a short run, fast health checks, no periodic checkpoints, no sample or evaluation.
DEFAULTS = {"run": {"steps": 5, "step_timeout_s": 30.0}, "health": {"interval_s": 0.05, "timeout_s": 0.05},
            "checkpoint": {"every": 0}, "sample": {"tokens": 0}, "eval": {"batches": 0}}


def make_config(**sections: dict) -> Config:
    """A small config (DEFAULTS); each keyword is a section and the fields it sets, e.g.
    make_config(run={"steps": 10}, checkpoint={"every": 3})."""
    config = Config(model=ModelConfig(vocab_size=256), data=DataConfig(seq_len=8, global_batch=4))
    tables = {name: {**DEFAULTS.get(name, {}), **sections.get(name, {})} for name in {*DEFAULTS, *sections}}
    return dataclasses.replace(config, **{name: dataclasses.replace(getattr(config, name), **fields)
                                          for name, fields in tables.items()})


class FakeBatches:
    """Batch i is filled with the value i, so a pod can tell which batch it got."""

    def __init__(self, rows: int = 4, seq_len: int = 8):
        self.rows, self.seq_len = rows, seq_len

    def batch(self, index: int) -> np.ndarray:
        return np.full((self.rows, self.seq_len + 1), index, dtype=np.int32)

    def loss_mask(self, index: int) -> None:
        return None

    def epoch(self, index: int) -> float:
        return (index + 1) / 100


class FakeCall:
    """A PendingCall stand-in: finished with a result or an error, or pending until finish()."""

    def __init__(self, result=None, error: Exception | None = None, pending: bool = False):
        self._result, self._error = result, error
        self._done = threading.Event()
        self.cancelled = False
        if not pending:
            self._done.set()

    def finish(self, result=None, error: Exception | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self):
        assert self._done.is_set(), "result() of a call that has not finished"
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        self.cancelled = True
        self._done.set()


def step_reply(pod: int, step: int, *, checksum: str | None = None, skipped: bool = False,
               loss: float = 2.0, tokens: int = 16, fingerprint: str = "") -> pb.StepReply:
    return pb.StepReply(step=step, pod_index=pod, loss_sum=loss * tokens, tokens=tokens, grad_norm=1.0,
                        learning_rate=1e-3, skipped=skipped, checksum=checksum or f"fp{step}",
                        fingerprint=fingerprint,
                        timings=pb.StepTimings(compute_s=0.01 * (pod + 1)))


def a_step_record(step: int, loss: float = 2.0, pods=(0, 1), **fields) -> StepRecord:
    """A StepRecord of `pods` (all live, each computing its own shard) with plausible values, its
    checksum c{step} on every pod; `fields` override any field."""
    timings = tuple(PodTimings(pod=p, compute_s=0.5, exchange_s=0.3, exposed_exchange_s=0.1, update_s=0.2,
                               wait_s=0.0, checksum_s=0.01, idle_s=0.05, dcn_bytes_sent=100) for p in pods)
    values = dict(step=step, loss=loss, z_loss=loss / 100, hosts=tuple(range(len(pods))), live_pods=len(pods),
                  grad_norm=1.0, learning_rate=1e-3, skipped=False, checksums=(f"c{step}",) * len(pods),
                  step_time_s=1.0, compute_time_s=0.5, exchange_time_s=0.3, update_time_s=0.2, idle_time_s=0.05,
                  exposed_exchange_s=0.1, checksum_time_s=0.01, pods=timings, dcn_bytes_sent=100 * len(pods),
                  tokens=64, tokens_per_s=64.0, model_flops_per_token=6.0, mfu=None, hardware_flops_per_token=None,
                  hfu=None, time=1000.0 + step, data_index=step, epoch=(step + 1) / 100, skipped_steps=0, restarts=0)
    return StepRecord(**{**values, **fields})


def configure_reply(pod: int, **fields) -> pb.ConfigureReply:
    values = dict(protocol_version=protos.PROTOCOL_VERSION, pod_index=pod, mesh_shape=[1, 1], num_devices=1,
                  config_hash="hash", fingerprint="init", step=0, device_kind="cpu")
    return pb.ConfigureReply(**{**values, **fields})


class FakePod:
    """One fake pod. `step(pod, step, data_index)` (kept as on_step) returns a StepReply, raises a
    WorkerError or returns HANG; `on_configure(request)` answers Configure; `probes` is a list of
    Probe answers, then `probe_then` forever; once one of its steps hangs, it answers
    `probe_when_hung` (if given) instead. `calls` lists (RPC name, request) of its calls other than
    Step (step_requests holds those)."""

    def __init__(self, pod_index: int, step=None, probes=(), probe_then: Probe = SERVING, log: list | None = None,
                 probe_when_hung: Probe | None = None):
        self.pod_index, self.address = pod_index, f"fake:{pod_index}"
        self.name = f"pod {pod_index} ({self.address})"
        self.on_step = step or (lambda pod, s, data: step_reply(pod, s))
        self.probes, self.probe_then, self.probe_when_hung = list(probes), probe_then, probe_when_hung
        self.log = log if log is not None else []
        self.on_configure = lambda request: configure_reply(self.pod_index)
        self.calls: list[tuple[str, object]] = []
        self.step_requests: list[pb.StepRequest] = []
        self.hanging: list[FakeCall] = []
        self.configured = True
        self.num_devices = 0            # what Status reports (0: unknown, as a worker before jax starts)

    def probe(self, timeout_s: float) -> Probe:
        if self.hanging and self.probe_when_hung is not None:
            return self.probe_when_hung
        return self.probes.pop(0) if self.probes else self.probe_then

    def configure(self, request: pb.ConfigureRequest, timeout_s: float) -> pb.ConfigureReply:
        self.calls.append(("Configure", request))
        self.configured = True
        return self.on_configure(request)

    def step_async(self, request: pb.StepRequest, timeout_s: float) -> FakeCall:
        self.step_requests.append(request)
        data_index = int(codec.decode(request.tokens)[0, 0])
        self.log.append(("dispatch", self.pod_index, request.step, data_index))
        try:
            reply = self.on_step(self.pod_index, request.step, data_index)
        except WorkerError as exc:
            return FakeCall(error=exc)
        if reply is HANG:
            call = FakeCall(pending=True)
            self.hanging.append(call)
            return call
        return FakeCall(reply)

    def status(self, timeout_s: float = 5.0) -> pb.StatusReply:
        return pb.StatusReply(pod_index=self.pod_index, configured=self.configured, num_devices=self.num_devices)

    def wait_serving(self, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        pass


def unavailable(pod: FakePod, what: str = "Step") -> WorkerError:
    return WorkerError(f"{pod.name}: {what} failed: UNAVAILABLE: connection refused", grpc.StatusCode.UNAVAILABLE)


class ListSink:
    """A MetricsLog stand-in that keeps the records (and logs them to a shared event list)."""

    def __init__(self, log: list | None = None):
        self.records: list[StepRecord] = []
        self.evals: list[dict] = []
        self.log = log if log is not None else []
        self.closed = False

    def write(self, record: StepRecord) -> None:
        self.records.append(record)
        self.log.append(("record", record.step))

    def write_eval(self, record: dict) -> None:
        self.evals.append(record)

    def close(self) -> None:
        self.closed = True


class NoProgress:
    def update(self, record: StepRecord) -> None:
        pass

    def note(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
