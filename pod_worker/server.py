"""The gRPC adapter of one pod: the PodWorker service (driven by the controller) and the standard
health service, over a Pod (pod.py). Peers' gradients arrive on the data plane (pod_worker/dcn/),
whose listener start_server binds beside the gRPC port.

Each handler validates and decodes its request, calls the pod, and maps every failure to a
status code (_handler); a bad request never takes the server down. The worker answers
DEADLINE_EXCEEDED never by itself: its own waits end a little before the RPC's deadline with a
typed code (ABORTED, FAILED_PRECONDITION), so that code means only "the caller's deadline passed".
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from multipod import protos
from multipod.model import ConfigError, Sampling
from multipod.pod_worker import errors
from multipod.pod_worker.checkpoint import CheckpointError
from multipod.pod_worker.dcn import ExchangeError, Listener
from multipod.pod_worker.dcn.transfer import TransferError
from multipod.pod_worker.dcn.transport import parse_address
from multipod.pod_worker.generation import MAX_NEW_TOKENS, MAX_PROMPTS, collect
from multipod.pod_worker.hosts import HostLayout
from multipod.pod_worker.link_probe import LinkProbe
from multipod.pod_worker.pod import Pod, Setup
from multipod.pod_worker.schema import WorkerConfig
from multipod.protos import codec, multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import MalformedMessage, Security, add_port, default_security, server_interceptors

log = logging.getLogger(__name__)

# How long a request waits for the pod when its RPC carries no deadline (the controller always sets one).
DEFAULT_WAIT_S = 120.0
# The worker's own waits end this much before the RPC's deadline (at most a tenth of it), so that
# its typed answer reaches the caller before the caller's deadline does.
ANSWER_MARGIN_S = 0.5

# Handler threads of one worker (Step calls, at most run.dispatch_depth at once, plus status and
# health calls; gradients travel on the data plane, not here).
RPC_THREADS = 64
# A worker runs (pods - 1) x dcn.streams sending threads: a bound keeps that reasonable.
MAX_PODS = 32


class RequestError(Exception):
    """A request the adapter refuses; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# The pod's typed refusals (pod_worker/errors.py) -> status codes; first match wins.
_POD_ERROR_CODES = (
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotReady, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StepAborted, grpc.StatusCode.ABORTED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.CorruptCheckpoint, grpc.StatusCode.DATA_LOSS),
    (errors.SaveNotFound, grpc.StatusCode.NOT_FOUND),
)


def _code_of(exc: errors.PodError) -> grpc.StatusCode:
    for kind, code in _POD_ERROR_CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _handler(method):
    """Run a servicer method, turning every failure into a gRPC error (never a dead server)."""
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except RequestError as exc:
            context.abort(exc.code, str(exc))
        except errors.PodError as exc:
            context.abort(_code_of(exc), str(exc))
        except (ConfigError, codec.CodecError, MalformedMessage) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CheckpointError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ExchangeError, TransferError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:  # a bug or a resource error: report it, keep serving
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


_END = object()


def _stream_handler(method):
    """_handler for a server-streaming method: a failure before or between the messages becomes a
    gRPC error (never a dead server)."""
    def advance(self, stream, context):
        return next(stream, _END)
    advance.__name__ = method.__name__      # named in the log if it fails
    advance = _handler(advance)

    def wrapper(self, request, context):
        stream = method(self, request, context)      # a generator: nothing has run yet
        try:
            while (message := advance(self, stream, context)) is not _END:
                yield message
        finally:
            stream.close()
    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def _wait_budget(context, default_s: float = DEFAULT_WAIT_S) -> float:
    """Seconds the worker's own waits may take for this RPC: its time left, minus the margin."""
    remaining = context.time_remaining()
    remaining = default_s if remaining is None else max(0.0, remaining)
    return remaining - min(ANSWER_MARGIN_S, remaining / 10)


def _deadline(context) -> float:
    """_wait_budget as a time.monotonic() deadline."""
    return time.monotonic() + _wait_budget(context)


# Token ids travel as the narrowest of these that holds the vocabulary; the devices widen them.
TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


def _decode_tokens(setup: Setup, payload: bytes, rows: int | None) -> np.ndarray:
    """A codec-encoded [rows, seq_len + 1] batch of uint8, uint16 or int32 token ids, checked
    against the pod's config (kept in its dtype: the devices widen it)."""
    config = setup.config
    tokens = codec.decode(payload, max_bytes=protos.MAX_MESSAGE_BYTES)
    if tokens.dtype not in TOKEN_DTYPES or tokens.ndim != 2:
        raise _invalid(f"tokens must be a 2-d uint8, uint16 or int32 array, got {tokens.ndim}-d {tokens.dtype}")
    want_cols = config.train.seq_len + 1
    if tokens.shape[1] != want_cols or (rows is not None and tokens.shape[0] != rows):
        raise _invalid(f"tokens shape {tokens.shape} != expected ({rows if rows is not None else 'B'}, {want_cols})")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.model.vocab_size):
        raise _invalid(f"token ids must be in [0, {config.model.vocab_size})")
    return tokens


def _decode_mask(setup: Setup, payload: bytes, tokens: np.ndarray) -> np.ndarray | None:
    """A codec-encoded uint8 loss mask of 0s and 1s, one per target of `tokens` ([rows, seq_len]);
    None if empty (every target counts). Taken only by a prompt-tuning pod."""
    if not payload:
        return None
    if not setup.config.prompt.enabled:
        raise _invalid("loss_mask is taken only by a pod tuning a prompt (prompt.kind); this pod trains the whole "
                       "model on every target")
    mask = codec.decode(payload, max_bytes=protos.MAX_MESSAGE_BYTES)
    want = (tokens.shape[0], tokens.shape[1] - 1)
    if mask.dtype != np.uint8 or mask.shape != want:
        raise _invalid(f"loss_mask must be uint8 {want} (one per target), got {mask.dtype} {mask.shape}")
    if mask.size and mask.max() > 1:
        raise _invalid("loss_mask values must be 0 or 1")
    return mask


def _while_caller_waits(chunks, context):
    """The generation's chunks until the caller cancels or its deadline passes: then the decoding
    stops (it would only take the devices from the training steps)."""
    try:
        for chunk in chunks:
            if not context.is_active():
                return
            yield chunk
    finally:
        chunks.close()


def _accounting(trainer) -> dict:
    """ConfigureReply's compiled-step accounting fields (0 where XLA reports nothing)."""
    stats = trainer.compiled_stats()
    return {"hardware_flops_per_step": stats["hardware_flops_per_step"] or 0.0,
            "memory_argument_bytes": stats["argument_bytes"] or 0, "memory_output_bytes": stats["output_bytes"] or 0,
            "memory_temp_bytes": stats["temp_bytes"] or 0, "memory_peak_bytes": stats["peak_bytes"] or 0}


def _outer_step(report) -> pb.OuterStep | None:
    """A DiLoCo outer step's report (pod_worker/diloco.py OuterReport) on the wire; None if none."""
    if report is None:
        return None
    return pb.OuterStep(sync=report.sync, fragment=report.fragment, started_step=report.started_at,
                        seconds=report.seconds, exposed_s=report.exposed_s, pods=list(report.pods))


class PodWorkerService(pb_grpc.PodWorkerServicer):
    """The PodWorker service: the controller's requests, validated, run on the pod."""

    def __init__(self, pod: Pod, shutdown_event: threading.Event):
        self.pod = pod
        self.shutdown_event = shutdown_event

    @_handler
    def Configure(self, request: pb.ConfigureRequest, context) -> pb.ConfigureReply:
        pod_index = self.pod.pod_index
        if request.protocol_version != protos.PROTOCOL_VERSION:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"protocol version mismatch: controller speaks {request.protocol_version}, "
                               f"{self.pod.layout.name(pod_index)} speaks {protos.PROTOCOL_VERSION}")
        if pod_index is not None and request.pod_index != pod_index and not request.standby:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this worker serves pod {pod_index}, not pod {request.pod_index}")
        if request.num_pods < 1 or len(request.peer_addresses) != request.num_pods:
            raise _invalid(f"num_pods={request.num_pods} but {len(request.peer_addresses)} peer addresses")
        if request.pod_index >= request.num_pods:
            raise _invalid(f"pod_index {request.pod_index} >= num_pods {request.num_pods}")
        if request.num_pods > MAX_PODS:
            raise _invalid(f"num_pods={request.num_pods}: a worker serves at most {MAX_PODS} pods "
                           f"(MAX_PODS in pod_worker/server.py)")
        if request.num_pods > 1 and len(request.dcn_addresses) != request.num_pods:
            raise _invalid(f"num_pods={request.num_pods} but {len(request.dcn_addresses)} data-plane addresses")
        if not request.run_id:
            raise _invalid("run_id is empty")
        layout = self.pod.layout
        hosts = request.hosts_per_pod or 1
        if (request.host_index, hosts) != (layout.host_index, layout.hosts_per_pod):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the controller takes this worker for host {request.host_index} of {hosts} of pod "
                               f"{request.pod_index}; it is host {layout.host_index} of {layout.hosts_per_pod} "
                               f"(--host-index / --hosts-per-pod)")
        config = WorkerConfig.from_json(request.worker_config_json)
        dcn_addresses = list(request.dcn_addresses) or [""] * request.num_pods   # one pod: no data plane
        if request.keep_state:
            trainer, fp = self.pod.reattach(config, request.num_pods, dcn_addresses, request.run_id,
                                            _deadline(context))
        else:
            # A spare takes the slot it is configured for (and keeps it: it is that pod from now on),
            # or with standby only compiles.
            trainer, fp = self.pod.configure(config, request.num_pods, dcn_addresses, request.run_id,
                                             pod_index=int(request.pod_index), standby=request.standby)
        pod_index = self.pod.pod_index if self.pod.pod_index is not None else request.pod_index
        import jax
        return pb.ConfigureReply(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=pod_index,
            mesh_shape=list(trainer.mesh_shape), num_devices=trainer.num_devices,
            config_hash=config.config_hash(), fingerprint=fp,
            param_count=sum(s.nbytes // s.dtype.itemsize for s in trainer.leaf_specs),
            device_kind=jax.devices()[0].device_kind, step=trainer.step,
            base_fingerprint=trainer.base_fingerprint, **_accounting(trainer))

    @_handler
    def Step(self, request: pb.StepRequest, context) -> pb.StepReply:
        setup = self.pod.setup()
        # This host's rows of the pod's shard.
        rows = setup.config.train.global_batch // setup.num_pods // self.pod.layout.hosts_per_pod
        tokens = _decode_tokens(setup, request.tokens, rows)
        mask = _decode_mask(setup, request.loss_mask, tokens)
        if request.global_tokens <= 0:
            raise _invalid("global_tokens must be positive")
        extra, extra_masks, splits = {}, {}, {}
        for shard in request.extra_shards:
            if shard.slot in extra or shard.slot == self.pod.pod_index or shard.slot >= setup.num_pods:
                raise _invalid(f"extra shard for slot {shard.slot}: a duplicate, this pod's own, or out of range")
            extra[shard.slot] = _decode_tokens(setup, shard.tokens, rows)
            extra_masks[shard.slot] = _decode_mask(setup, shard.loss_mask, extra[shard.slot])
            splits[shard.slot] = [int(h) for h in shard.microbatch_hosts]    # checked by Pod.step
        outcome, wait_s = self.pod.step(setup, request.step, tokens, request.global_tokens, _deadline(context),
                                        context.is_active, take_fingerprint=request.take_fingerprint, extra=extra,
                                        loss_mask=mask, extra_masks=extra_masks, splits=splits)
        link = outcome.link
        shards = [pb.ShardResult(slot=self.pod.pod_index if slot is None else slot, loss_sum=loss, z_loss_sum=z,
                                 tokens=count) for slot, loss, z, count in outcome.shards]
        return pb.StepReply(
            step=request.step, pod_index=self.pod.pod_index, loss_sum=outcome.loss_sum,
            z_loss_sum=outcome.z_loss_sum, tokens=outcome.tokens, grad_norm=outcome.grad_norm,
            learning_rate=outcome.learning_rate, skipped=outcome.skipped, checksum=outcome.checksum,
            fingerprint=outcome.fingerprint,
            timings=pb.StepTimings(wait_s=wait_s, compute_s=outcome.compute_s, exchange_s=outcome.exchange_s,
                                   update_s=outcome.update_s, checksum_s=outcome.checksum_s,
                                   fingerprint_s=outcome.fingerprint_s,
                                   idle_s=link.idle_s if link else 0.0,
                                   exposed_exchange_s=outcome.exposed_exchange_s),
            dcn_bytes_sent=link.bytes_sent if link else 0,
            dcn_bytes_received=link.bytes_received if link else 0, shards=shards,
            outer=_outer_step(outcome.outer))

    @_handler
    def Evaluate(self, request: pb.EvaluateRequest, context) -> pb.EvaluateReply:
        setup = self.pod.setup()
        tokens = _decode_tokens(setup, request.tokens, None)
        data_axis = setup.trainer.mesh_shape[0]
        if tokens.shape[0] == 0 or tokens.shape[0] % data_axis:
            raise _invalid(f"evaluation batch of {tokens.shape[0]} rows must be a positive multiple of "
                           f"the data axis ({data_axis})")
        mask = _decode_mask(setup, request.loss_mask, tokens)
        loss_sum, count = self.pod.evaluate(tokens, _deadline(context), mask)
        return pb.EvaluateReply(loss_sum=loss_sum, tokens=count)

    def _generation(self, request: pb.GenerateRequest, context):
        """A Generate request, checked and started: (the stream of Chunks, the prompts' count,
        whether it used the one-prompt form)."""
        self.pod.setup()     # FAILED_PRECONDITION first if the pod is not configured
        if bool(request.prompt) == bool(request.prompts):
            raise _invalid("give exactly one of prompt (one prompt) or prompts (a batch)")
        payloads = [request.prompt] if request.prompt else list(request.prompts)
        if len(payloads) > MAX_PROMPTS:
            raise _invalid(f"{len(payloads)} prompts: a request carries at most {MAX_PROMPTS} "
                           f"(MAX_PROMPTS in pod_worker/generation.py)")
        prompts = []
        for i, payload in enumerate(payloads):
            prompt = codec.decode(payload, max_bytes=1 << 20)
            if prompt.dtype not in TOKEN_DTYPES or prompt.ndim != 1:
                name = "prompt" if request.prompt else f"prompt {i}"
                raise _invalid(f"{name} must be a 1-d uint8, uint16 or int32 array, got {prompt.ndim}-d {prompt.dtype}")
            prompts.append(prompt.astype(np.int32))
        if not 0 < request.num_tokens <= MAX_NEW_TOKENS:
            raise _invalid(f"num_tokens must be in [1, {MAX_NEW_TOKENS}], got {request.num_tokens}")
        sampling = Sampling(temperature=float(request.temperature), top_k=int(request.top_k),
                            top_p=float(request.top_p) if request.HasField("top_p") else 1.0, seed=int(request.seed))
        eos_id = int(request.eos_id) if request.HasField("eos_id") else None
        # The model's own checks (prompt lengths against max_seq_len, ids, sampling values) answer
        # INVALID_ARGUMENT through the pod's InvalidRequest.
        chunks = self.pod.generate_stream(prompts, int(request.num_tokens), sampling, _deadline(context),
                                          eos_id=eos_id, shift_context=request.shift_context)
        return chunks, len(prompts), bool(request.prompt)

    @_handler
    def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateReply:
        chunks, count, single = self._generation(request, context)
        out, lengths = collect(_while_caller_waits(chunks, context), count, request.num_tokens)
        tokens = out[0, :lengths[0]] if single else out
        return pb.GenerateReply(tokens=codec.encode(tokens), lengths=lengths.tolist())

    @_stream_handler
    def GenerateStream(self, request: pb.GenerateRequest, context):
        chunks, _, _ = self._generation(request, context)
        for chunk in _while_caller_waits(chunks, context):
            yield pb.GenerateChunk(index=chunk.index, rows=chunk.rows.tolist(), tokens=codec.encode(chunk.tokens))

    @_handler
    def Save(self, request: pb.SaveRequest, context) -> pb.SaveReply:
        """Start a checkpoint of the state after `step` steps; with background=false, also wait
        for it to be written (within the RPC's deadline)."""
        self.pod.setup()
        if not request.directory:
            raise _invalid("directory is empty")
        try:
            metadata = json.loads(request.metadata_json or "{}")
        except ValueError:
            raise _invalid("metadata_json is not valid JSON") from None
        if not isinstance(metadata, dict):
            raise _invalid("metadata_json must be a JSON object")
        started = self.pod.start_save(request.step, request.directory, metadata, int(request.keep),
                                      _deadline(context))
        if request.background:
            return pb.SaveReply(path=str(started.path), fingerprint=started.fingerprint, pending=True)
        self.pod.wait_save(request.directory, started.step, _wait_budget(context, default_s=600.0))
        return pb.SaveReply(path=str(started.path), fingerprint=started.fingerprint)

    @_handler
    def WaitSave(self, request: pb.WaitSaveRequest, context) -> pb.SaveReply:
        """How the background save of `step` went (waits for it within the RPC's deadline;
        FAILED_PRECONDITION if it is still being written then)."""
        self.pod.setup()
        if not request.directory:
            raise _invalid("directory is empty")
        path = self.pod.wait_save(request.directory, int(request.step), _wait_budget(context, default_s=60.0))
        return pb.SaveReply(path=str(path))

    @_handler
    def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreReply:
        self.pod.setup()
        if bool(request.path) == bool(request.directory):
            raise _invalid("give exactly one of path (a checkpoint) or directory (restore its newest checkpoint)")
        restored = self.pod.restore(request.path or None, request.directory or None, request.run_id,
                                    _deadline(context))
        return pb.RestoreReply(step=restored.step, fingerprint=restored.fingerprint,
                               metadata_json=json.dumps(restored.metadata), path=restored.path)

    @_handler
    def Status(self, request, context) -> pb.StatusReply:
        status = self.pod.status()
        import jax
        pod_index = self.pod.pod_index
        return pb.StatusReply(protocol_version=protos.PROTOCOL_VERSION,
                              pod_index=-1 if pod_index is None else pod_index, spare=pod_index is None,
                              configured=status.configured, step=status.step, num_devices=len(jax.devices()),
                              state=status.state, pid=os.getpid(),
                              dcn_address=self.pod.listener.address if self.pod.listener else "",
                              config_hash=status.config_hash, checksum=status.checksum, run_id=status.run_id,
                              host_index=self.pod.layout.host_index, hosts_per_pod=self.pod.layout.hosts_per_pod,
                              pod_coordinator=self.pod.layout.coordinator, local_devices=jax.local_device_count())

    @_handler
    def SetMembership(self, request: pb.MembershipRequest, context) -> pb.MembershipReply:
        """Degraded mode and rejoin: a new exchange among the pods in `hosts` (pod.set_membership)."""
        setup = self.pod.setup()
        if not request.run_id:
            raise _invalid("run_id is empty")
        if request.num_pods != setup.num_pods:
            raise _invalid(f"num_pods={request.num_pods}, the pod was configured for {setup.num_pods}")
        if request.dcn_addresses and len(request.dcn_addresses) != setup.num_pods:
            raise _invalid(f"{len(request.dcn_addresses)} data-plane addresses for {setup.num_pods} pods")
        membership = self.pod.set_membership(request.run_id, list(request.hosts) or None, _deadline(context),
                                             peers=list(request.dcn_addresses) or None)
        return pb.MembershipReply(step=membership.step, checksum=membership.checksum,
                                  fingerprint=membership.fingerprint, config_hash=membership.config_hash,
                                  aborted_step=membership.aborted_step)

    @_handler
    def SendState(self, request: pb.SendStateRequest, context) -> pb.TransferReply:
        """Stream this pod's state to a rejoining pod over the data plane."""
        if not request.transfer_id or not request.to_address:
            raise _invalid("transfer_id and to_address are required")
        sent = self.pod.send_state(request.transfer_id, int(request.to_pod), request.to_address, _deadline(context))
        return pb.TransferReply(step=sent.step, fingerprint=sent.fingerprint, bytes=sent.bytes,
                                seconds=sent.seconds)

    @_handler
    def ReceiveState(self, request: pb.ReceiveStateRequest, context) -> pb.TransferReply:
        """Take a live pod's state, verified by its fingerprint before it replaces this pod's."""
        if not request.transfer_id:
            raise _invalid("transfer_id is empty")
        got = self.pod.receive_state(request.transfer_id, int(request.from_pod), _deadline(context))
        return pb.TransferReply(step=got.step, fingerprint=got.fingerprint, bytes=got.bytes,
                                seconds=got.seconds)

    @_handler
    def AdoptSlot(self, request: pb.AdoptSlotRequest, context) -> pb.AdoptSlotReply:
        """DiLoCo "replay": host a failed pod's replica, retaking its inner steps from its checkpoint part."""
        setup = self.pod.setup()
        if not request.checkpoint_path:
            raise _invalid("checkpoint_path is empty")
        rows = setup.config.train.global_batch // setup.num_pods
        batches = [_decode_tokens(setup, payload, rows) for payload in request.tokens]
        step, fp = self.pod.adopt_slot(int(request.slot), request.checkpoint_path, batches, _deadline(context))
        return pb.AdoptSlotReply(step=step, fingerprint=fp)

    @_handler
    def ProbeLink(self, request: pb.ProbeLinkRequest, context) -> pb.ProbeLinkReply:
        """Time the data plane with the other probing pods (pod_worker/link_probe.py)."""
        if request.protocol_version != protos.PROTOCOL_VERSION:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"protocol version mismatch: controller speaks {request.protocol_version}, "
                               f"this worker speaks {protos.PROTOCOL_VERSION}")
        probe = LinkProbe.from_request(request)
        seconds, sent = self.pod.probe_link(probe, _deadline(context), prepare=request.prepare)
        return pb.ProbeLinkReply(seconds=seconds, bytes_sent=sent,
                                 encrypted=parse_address(self.pod.listener.address)[1] if self.pod.listener else False)

    @_handler
    def Shutdown(self, request, context) -> pb.ShutdownReply:
        log.info("shutdown requested")
        self.shutdown_event.set()
        return pb.ShutdownReply()


def start_server(pod_index: int | None, listen: str, security: Security | None = None, max_workers: int = RPC_THREADS,
                 dcn_listen: str | None = None, dcn_encrypt: bool = False, layout: HostLayout | None = None):
    """Build and start one pod's server and its data-plane listener (on `dcn_listen`, default the
    gRPC host with an ephemeral port; CURVE-encrypted with dcn_encrypt); returns (server,
    PodWorkerService, health servicer, bound port). The pod is `service.pod` (its listener
    `service.pod.listener`); `service.shutdown_event` is set by the Shutdown RPC."""
    token = (security or default_security()).token
    listener = Listener(pod_index, dcn_listen or f"{listen.rsplit(':', 1)[0]}:0", token, curve=dcn_encrypt)
    pod = Pod(pod_index, listener, layout)
    service = PodWorkerService(pod, threading.Event())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                         interceptors=server_interceptors(security), options=protos.channel_options(),
                         maximum_concurrent_rpcs=max_workers * 4)
    pb_grpc.add_PodWorkerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, listen, security)
    if port == 0:
        listener.close()
        raise SystemExit(f"{pod.layout.name(pod_index)}: cannot listen on {listen}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("multipod.PodWorker", health_pb2.HealthCheckResponse.SERVING)
    return server, service, health_servicer, port
