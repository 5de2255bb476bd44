"""The gRPC server of one pod: the PodWorker service (driven by the controller) and the Dcn
service (peers' gradient streams), plus the standard gRPC health service.

Every handler validates its request and maps failures to a status code; a bad request never
takes the server down, and a failed step leaves the pod's state as it was before the step.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from multipod import protos
from multipod.model import ConfigError
from multipod.pod_worker import checkpoint, faults
from multipod.pod_worker.checkpoint import CheckpointError
from multipod.pod_worker.config import WorkerConfig
from multipod.pod_worker.dcn import Exchange, ExchangeError, InvalidChunk
from multipod.pod_worker.trainer import PodTrainer
from multipod.protos import codec, multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.transport import MalformedMessage, Security, add_port, server_interceptors

log = logging.getLogger(__name__)

# How long a request waits for the pod when its RPC carries no deadline (the controller always sets one).
DEFAULT_WAIT_S = 120.0


class RequestError(Exception):
    """A request the worker refuses; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _accounting(trainer) -> dict:
    """ConfigureReply's compiled-step accounting fields (0 where XLA reports nothing)."""
    stats = trainer.compiled_stats()
    return {"hardware_flops_per_step": stats["hardware_flops_per_step"] or 0.0,
            "memory_argument_bytes": stats["argument_bytes"] or 0, "memory_output_bytes": stats["output_bytes"] or 0,
            "memory_temp_bytes": stats["temp_bytes"] or 0, "memory_peak_bytes": stats["peak_bytes"] or 0}


def _handler(method):
    """Run a servicer method, turning every failure into a gRPC error (never a dead server)."""
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except RequestError as exc:
            context.abort(exc.code, str(exc))
        except (ConfigError, codec.CodecError, InvalidChunk, MalformedMessage) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CheckpointError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ExchangeError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:  # a bug or a resource error: report it, keep serving
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    wrapper.__name__ = method.__name__
    return wrapper


class PodWorkerService(pb_grpc.PodWorkerServicer, pb_grpc.DcnServicer):
    """All state of one pod worker; both services share it."""

    def __init__(self, pod_index: int, shutdown_event: threading.Event):
        self.pod_index = pod_index
        self.shutdown_event = shutdown_event
        self.trainer: PodTrainer | None = None
        self.exchange: Exchange | None = None
        self.config: WorkerConfig | None = None
        self.num_pods = 0
        self._cond = threading.Condition()   # guards trainer.step / _failed_step / _busy
        self._busy = False
        self._failed_step: int | None = None
        self._state = pb.WORKER_STATE_IDLE
        self._peers: list[str] = []
        self._epoch = 0     # bumped by Restore: steps queued before it belong to an abandoned timeline
        self._writer = checkpoint.Writer()

    # -- PodWorker -------------------------------------------------------------------------------
    @_handler
    def Configure(self, request: pb.ConfigureRequest, context) -> pb.ConfigureReply:
        if request.protocol_version != protos.PROTOCOL_VERSION:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"protocol version mismatch: controller speaks {request.protocol_version}, "
                               f"pod {self.pod_index} speaks {protos.PROTOCOL_VERSION}")
        if request.pod_index != self.pod_index:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this worker serves pod {self.pod_index}, not pod {request.pod_index}")
        if request.num_pods < 1 or len(request.peer_addresses) != request.num_pods:
            raise _invalid(f"num_pods={request.num_pods} but {len(request.peer_addresses)} peer addresses")
        if request.pod_index >= request.num_pods:
            raise _invalid(f"pod_index {request.pod_index} >= num_pods {request.num_pods}")
        if request.num_pods > MAX_PODS:
            raise _invalid(f"num_pods={request.num_pods}: a worker serves at most {MAX_PODS} pods "
                           f"(RPC_THREADS={RPC_THREADS} in pod_worker/server.py)")
        if not request.run_id:
            raise _invalid("run_id is empty")
        config = WorkerConfig.from_json(request.worker_config_json)
        with self._cond:
            if self._busy:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "a step is running")
            self._state = pb.WORKER_STATE_CONFIGURING
        try:
            trainer = PodTrainer(config)
            per_pod = config.train.global_batch // request.num_pods
            trainer.compile_for((per_pod, config.train.seq_len + 1))
        except Exception:
            with self._cond:
                self._state = pb.WORKER_STATE_READY if self.trainer else pb.WORKER_STATE_IDLE
            raise
        if self.exchange is not None:
            self.exchange.close()
        self._peers = list(request.peer_addresses)
        exchange = self._new_exchange(request.run_id, trainer, config)
        with self._cond:
            self.trainer, self.exchange, self.config = trainer, exchange, config
            self.num_pods = request.num_pods
            self._failed_step = None
            self._state = pb.WORKER_STATE_READY
            self._cond.notify_all()
        import jax
        return pb.ConfigureReply(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=self.pod_index,
            mesh_shape=list(trainer.mesh_shape), num_devices=trainer.num_devices,
            config_hash=config.config_hash(), fingerprint=trainer.fingerprint(),
            param_count=sum(s.nbytes // s.dtype.itemsize for s in trainer.leaf_specs),
            device_kind=jax.devices()[0].device_kind, step=trainer.step, **_accounting(trainer))

    def _new_exchange(self, run_id: str, trainer: PodTrainer, config: WorkerConfig) -> Exchange:
        return Exchange(run_id, self.pod_index, self._peers, trainer.leaf_specs, config.dcn.chunk_bytes,
                        config.dcn.timeout_s, dcn=config.dcn)

    def _require_trainer(self) -> PodTrainer:
        if self.trainer is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"pod {self.pod_index} is not configured")
        return self.trainer

    def _decode_tokens(self, payload: bytes, rows: int | None) -> np.ndarray:
        config = self.config
        tokens = codec.decode(payload, max_bytes=protos.MAX_MESSAGE_BYTES)
        if tokens.dtype != np.int32 or tokens.ndim != 2:
            raise _invalid(f"tokens must be a 2-d int32 array, got {tokens.ndim}-d {tokens.dtype}")
        want_cols = config.train.seq_len + 1
        if tokens.shape[1] != want_cols or (rows is not None and tokens.shape[0] != rows):
            raise _invalid(f"tokens shape {tokens.shape} != expected ({rows if rows is not None else 'B'}, {want_cols})")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= config.model.vocab_size):
            raise _invalid(f"token ids must be in [0, {config.model.vocab_size})")
        return tokens

    @_handler
    def Step(self, request: pb.StepRequest, context) -> pb.StepReply:
        trainer = self._require_trainer()
        rows = self.config.train.global_batch // self.num_pods
        tokens = self._decode_tokens(request.tokens, rows)
        if request.global_tokens <= 0:
            raise _invalid("global_tokens must be positive")
        if request.step < trainer.step:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"step {request.step} is already done (pod {self.pod_index} is at step {trainer.step})")
        # The shard goes to the devices now, while an earlier step may still be computing.
        on_device = trainer.put_batch(tokens)
        wait_start = time.perf_counter()
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else DEFAULT_WAIT_S)
        with self._cond:
            epoch = self._epoch
            while self._busy or trainer.step != request.step:
                if self.trainer is not trainer:
                    raise RequestError(grpc.StatusCode.ABORTED, "the pod was reconfigured")
                if self._epoch != epoch:
                    raise RequestError(grpc.StatusCode.ABORTED, "the pod was restored to a checkpoint")
                if not context.is_active():
                    raise RequestError(grpc.StatusCode.CANCELLED, "the controller cancelled the step")
                if self._failed_step is not None and self._failed_step < request.step:
                    raise RequestError(grpc.StatusCode.ABORTED,
                                       f"step {self._failed_step} failed on pod {self.pod_index}; "
                                       f"step {request.step} cannot run")
                if not self._busy and trainer.step > request.step:
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"step {request.step} is already done")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"pod {self.pod_index} still at step {trainer.step}, step {request.step} timed out waiting")
                self._cond.wait(min(left, 1.0))
            self._busy = True
            self._state = pb.WORKER_STATE_STEPPING
        try:
            return self._run_step(trainer, request, on_device, time.perf_counter() - wait_start)
        except BaseException:
            with self._cond:
                self._failed_step = request.step
            raise
        finally:
            with self._cond:
                self._busy = False
                self._state = pb.WORKER_STATE_READY
                self._cond.notify_all()

    def _run_step(self, trainer: PodTrainer, request, on_device, wait_s: float) -> pb.StepReply:
        exchange = self.exchange
        exchange.inbox.set_next_step(request.step)
        all_reduce = None
        if self.num_pods > 1:
            # Leaf by leaf: host copy -> chunks on the wire -> pod-order sum -> host->device.
            all_reduce = lambda grads: exchange.all_reduce(request.step, grads, on_leaf=trainer.put_leaf)
        if faults.nan_gradient_at(self.pod_index, request.step):   # test hook (pod_worker/faults.py)
            all_reduce = faults.poisoned(all_reduce)
        outcome = trainer.train_step(on_device, request.global_tokens, all_reduce)
        exchange.inbox.set_next_step(trainer.step)
        link = outcome.link
        return pb.StepReply(
            step=request.step, pod_index=self.pod_index, loss_sum=outcome.loss_sum, z_loss_sum=outcome.z_loss_sum,
            tokens=outcome.tokens, grad_norm=outcome.grad_norm, learning_rate=outcome.learning_rate,
            skipped=outcome.skipped, fingerprint=outcome.fingerprint,
            timings=pb.StepTimings(wait_s=wait_s, compute_s=outcome.compute_s, exchange_s=outcome.exchange_s,
                                   update_s=outcome.update_s, fingerprint_s=outcome.fingerprint_s,
                                   idle_s=link.idle_s if link else 0.0),
            dcn_bytes_sent=link.bytes_sent if link else 0,
            dcn_bytes_received=link.bytes_received if link else 0)

    @_handler
    def Evaluate(self, request: pb.EvaluateRequest, context) -> pb.EvaluateReply:
        trainer = self._require_trainer()
        tokens = self._decode_tokens(request.tokens, None)
        data_axis = trainer.mesh_shape[0]
        if tokens.shape[0] == 0 or tokens.shape[0] % data_axis:
            raise _invalid(f"evaluation batch of {tokens.shape[0]} rows must be a positive multiple of "
                           f"the data axis ({data_axis})")
        with self._cond:
            loss_sum, count = trainer.evaluate(tokens)
        return pb.EvaluateReply(loss_sum=loss_sum, tokens=count)

    @_handler
    def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateReply:
        from multipod.model import generate
        trainer = self._require_trainer()
        prompt = codec.decode(request.prompt, max_bytes=1 << 20)
        vocab = self.config.model.vocab_size
        if prompt.dtype != np.int32 or prompt.ndim != 1 or prompt.size == 0:
            raise _invalid("prompt must be a non-empty 1-d int32 array")
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise _invalid(f"prompt token ids must be in [0, {vocab})")
        if not 0 < request.num_tokens <= 4096:
            raise _invalid(f"num_tokens must be in [1, 4096], got {request.num_tokens}")
        if not np.isfinite(request.temperature) or request.temperature < 0:
            raise _invalid(f"temperature must be >= 0, got {request.temperature}")
        with self._cond:
            params = trainer.host_state()["params"]
        out = generate(params, self.config.model, prompt, int(request.num_tokens),
                       float(request.temperature), int(request.seed))
        return pb.GenerateReply(tokens=codec.encode(np.asarray(out, np.int32)))

    def _wait_idle(self, context) -> None:
        """Wait (under self._cond) until no step runs, within the RPC's deadline."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else DEFAULT_WAIT_S)
        while self._busy:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"pod {self.pod_index}: a step is still running")
            self._cond.wait(min(left, 1.0))

    @_handler
    def Save(self, request: pb.SaveRequest, context) -> pb.SaveReply:
        trainer = self._require_trainer()
        if not request.directory:
            raise _invalid("directory is empty")
        try:
            metadata = json.loads(request.metadata_json or "{}")
        except ValueError:
            raise _invalid("metadata_json is not valid JSON") from None
        if not isinstance(metadata, dict):
            raise _invalid("metadata_json must be a JSON object")
        with self._cond:
            self._wait_idle(context)
            if request.step != trainer.step:
                raise _invalid(f"save requested for step {request.step}, pod {self.pod_index} is at step {trainer.step}")
            # Host copies: the only part the step loop waits for; the write runs in the background.
            state = trainer.host_state()
            fp = trainer.fingerprint()
        metadata["worker_config"] = self.config.to_dict()
        metadata["state_key"] = self.config.state_key()
        keep = int(request.keep) or None
        path = self._writer.submit(request.directory, state, fp, json.dumps(metadata), keep)
        if request.background:
            return pb.SaveReply(path=str(path), fingerprint=fp, pending=True)
        remaining = context.time_remaining()
        self._writer.wait(request.directory, int(state["step"]), remaining if remaining is not None else 600.0)
        return pb.SaveReply(path=str(path), fingerprint=fp)

    @_handler
    def WaitSave(self, request: pb.WaitSaveRequest, context) -> pb.SaveReply:
        """How the background save of `step` went (waits for it within the RPC's deadline)."""
        self._require_trainer()
        if not request.directory:
            raise _invalid("directory is empty")
        remaining = context.time_remaining()
        try:
            path = self._writer.wait(request.directory, int(request.step),
                                     max(0.0, (remaining if remaining is not None else 60.0) - 0.5))
        except KeyError as exc:
            raise RequestError(grpc.StatusCode.NOT_FOUND, str(exc.args[0])) from None
        except TimeoutError as exc:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        return pb.SaveReply(path=str(path))

    @_handler
    def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreReply:
        trainer = self._require_trainer()
        if bool(request.path) == bool(request.directory):
            raise _invalid("give exactly one of path (a checkpoint) or directory (restore its newest checkpoint)")
        path = str(request.path) if request.path else str(checkpoint.latest(request.directory))
        metadata = checkpoint.read_metadata(path)
        checkpoint.check_compatible(path, metadata, self.config.state_key())
        with self._cond:
            self._wait_idle(context)
            self._state = pb.WORKER_STATE_RESTORING
            try:
                state, metadata = checkpoint.restore(path, trainer.host_state())
                if int(state["step"]) != int(metadata.get("step", -1)):
                    raise CheckpointError(f"checkpoint {path}: state is at step {state['step']}, "
                                          f"metadata says {metadata.get('step')}")
                trainer.load_state(state["params"], state["opt_state"], state["step"])
            finally:
                self._state = pb.WORKER_STATE_READY
            fp = trainer.fingerprint()
            if metadata.get("fingerprint") != fp:
                # The arrays read back are not the ones written: a corrupt checkpoint.
                raise RequestError(grpc.StatusCode.DATA_LOSS,
                                   f"checkpoint {path} is corrupt: the restored state's fingerprint {fp} "
                                   f"!= the fingerprint saved with it {metadata.get('fingerprint')}")
            self._failed_step = None
            self._epoch += 1
            if request.run_id:
                # A fresh DCN inbox under a new run id: nothing a peer sent before the restore
                # (streams of the abandoned timeline) can be taken for a step of the new one.
                self.exchange.close()
                self.exchange = self._new_exchange(request.run_id, trainer, self.config)
            self.exchange.inbox.set_next_step(trainer.step)
            self._cond.notify_all()
        return pb.RestoreReply(step=trainer.step, fingerprint=fp, metadata_json=json.dumps(metadata), path=path)

    @_handler
    def Status(self, request, context) -> pb.StatusReply:
        trainer = self.trainer
        import jax
        return pb.StatusReply(protocol_version=protos.PROTOCOL_VERSION, pod_index=self.pod_index,
                              configured=trainer is not None, step=trainer.step if trainer else 0,
                              num_devices=len(jax.devices()), state=self._state, pid=os.getpid())

    @_handler
    def Shutdown(self, request, context) -> pb.ShutdownReply:
        log.info("shutdown requested")
        self.shutdown_event.set()
        return pb.ShutdownReply()

    # -- Dcn -------------------------------------------------------------------------------------
    @_handler
    def PushGradients(self, request_iterator, context) -> pb.PushAck:
        exchange = self.exchange
        if exchange is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"pod {self.pod_index} is not configured")
        return exchange.inbox.receive(request_iterator)


# Handler threads of one worker. A step occupies one thread per incoming DCN stream: 2 steps in
# flight x (pods - 1) peers x at most max(1, 6 // (pods - 1)) streams, plus 2 Step calls and a few
# status/health calls, so this many threads serve up to MAX_PODS pods without a stream ever
# waiting for a free thread (which could deadlock the exchange).
RPC_THREADS = 64
MAX_PODS = (RPC_THREADS - 4) // 2 + 1


def start_server(pod_index: int, listen: str, security: Security | None = None, max_workers: int = RPC_THREADS):
    """Build and start one pod's server; returns (server, service, health servicer, bound port)."""
    shutdown = threading.Event()
    service = PodWorkerService(pod_index, shutdown)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                         interceptors=server_interceptors(security), options=protos.channel_options(),
                         maximum_concurrent_rpcs=max_workers * 4)
    pb_grpc.add_PodWorkerServicer_to_server(service, server)
    pb_grpc.add_DcnServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, listen, security)
    if port == 0:
        raise SystemExit(f"pod {pod_index}: cannot listen on {listen}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("multipod.PodWorker", health_pb2.HealthCheckResponse.SERVING)
    return server, service, health_servicer, port


def serve(pod_index: int, listen: str, port_file: str | None = None, exit_with_parent: bool = False,
          max_workers: int = RPC_THREADS, security: Security | None = None) -> None:
    """Serve one pod until Shutdown is called, the process is signalled, or (with
    exit_with_parent) the process that started it is gone."""
    server, service, health_servicer, port = start_server(pod_index, listen, security, max_workers)
    shutdown = service.shutdown_event
    host = listen.rsplit(":", 1)[0]
    log.info("pod %d serving on %s:%d (pid %d)", pod_index, host, port, os.getpid())
    if port_file:   # written last: whoever waits on it may connect at once
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, port_file)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: shutdown.set())
    try:
        while not shutdown.wait(0.5):
            if exit_with_parent and os.getppid() != parent:
                log.warning("parent process %d is gone; shutting down", parent)
                break
    except KeyboardInterrupt:
        pass
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2.0).wait(5.0)
    service._writer.close()
    if service.exchange is not None:
        service.exchange.close()
    log.info("pod %d stopped", pod_index)
