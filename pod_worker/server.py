"""The gRPC adapter of one pod: the PodWorker service (driven by the controller) and the standard
health service, over a Pod (pod.py). Peers' gradients arrive on the data plane (pod_worker/dcn/),
whose listener start_server binds beside the gRPC port.

Each handler validates and decodes its request, calls the pod, and maps every failure to a
status code (rpc_handler.py handler); a bad request never takes the server down. The worker answers
DEADLINE_EXCEEDED never by itself: its own waits end a little before the RPC's deadline with a
typed code (ABORTED, FAILED_PRECONDITION), so that code means only "the caller's deadline passed".

Here: PodWorkerService with the worker's own RPCs (Configure, Status, ProbeLink, Shutdown), and
start_server. The other RPCs are mixins of it, one module per concern: training_rpcs.py (Step,
Evaluate), state_rpcs.py (checkpoints, membership, state transfer, AdoptSlot) and
generation_rpcs.py (Generate, GenerateStream); request_tokens.py decodes the token batches they
carry.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from multipod import protos
from multipod.pod_worker.dcn import Listener
from multipod.pod_worker.dcn.transport import parse_address
from multipod.pod_worker.generation_rpcs import GenerationRpcs
from multipod.pod_worker.hosts import HostLayout
from multipod.pod_worker.link_probe import EncryptionProbe, LinkProbe
from multipod.pod_worker.pod import Pod
from multipod.pod_worker.request_tokens import TOKEN_DTYPES
from multipod.pod_worker.rpc_handler import ANSWER_MARGIN_S, DEFAULT_WAIT_S, RequestError, deadline, handler, invalid
from multipod.pod_worker.schema import WorkerConfig
from multipod.pod_worker.state_rpcs import StateRpcs
from multipod.pod_worker.training_rpcs import TrainingRpcs
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import Security, add_port, default_security, server_interceptors

# Names that moved to the modules of their concern, still importable from here.
__all__ = ["ANSWER_MARGIN_S", "DEFAULT_WAIT_S", "MAX_PODS", "RPC_THREADS", "TOKEN_DTYPES", "PodWorkerService",
           "RequestError", "start_server"]

log = logging.getLogger(__name__)

# Handler threads of one worker (Step calls, at most run.dispatch_depth at once, plus status and
# health calls; gradients travel on the data plane, not here).
RPC_THREADS = 64
# A worker runs (pods - 1) x dcn.streams (at most MAX_STREAMS) sending threads: a bound keeps that reasonable.
MAX_PODS = 32


def _accounting(trainer) -> dict:
    """ConfigureReply's compiled-step accounting fields (0 where XLA reports nothing, and all 0 for
    a pod configured to generate only, which did not compile the step)."""
    if not trainer.step_compiled:
        return {}
    stats = trainer.compiled_stats()
    return {"hardware_flops_per_step": stats["hardware_flops_per_step"] or 0.0,
            "memory_argument_bytes": stats["argument_bytes"] or 0, "memory_output_bytes": stats["output_bytes"] or 0,
            "memory_temp_bytes": stats["temp_bytes"] or 0, "memory_peak_bytes": stats["peak_bytes"] or 0}


class PodWorkerService(TrainingRpcs, StateRpcs, GenerationRpcs, pb_grpc.PodWorkerServicer):
    """The PodWorker service: the controller's requests, validated, run on the pod."""

    def __init__(self, pod: Pod, shutdown_event: threading.Event):
        self.pod = pod
        self.shutdown_event = shutdown_event

    @handler
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
            raise invalid(f"num_pods={request.num_pods} but {len(request.peer_addresses)} peer addresses")
        if request.pod_index >= request.num_pods:
            raise invalid(f"pod_index {request.pod_index} >= num_pods {request.num_pods}")
        if request.num_pods > MAX_PODS:
            raise invalid(f"num_pods={request.num_pods}: a worker serves at most {MAX_PODS} pods "
                           f"(MAX_PODS in pod_worker/server.py)")
        if request.num_pods > 1 and len(request.dcn_addresses) != request.num_pods:
            raise invalid(f"num_pods={request.num_pods} but {len(request.dcn_addresses)} data-plane addresses")
        if not request.run_id:
            raise invalid("run_id is empty")
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
                                            deadline(context))
        else:
            # A spare takes the slot it is configured for (and keeps it: it is that pod from now on),
            # or with standby only compiles.
            trainer, fp = self.pod.configure(config, request.num_pods, dcn_addresses, request.run_id,
                                             pod_index=int(request.pod_index), standby=request.standby,
                                             evaluates=request.evaluates,
                                             generation_only=request.generation_only,
                                             awaits_state=request.awaits_state)
        pod_index = self.pod.pod_index if self.pod.pod_index is not None else request.pod_index
        import jax
        return pb.ConfigureReply(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=pod_index,
            mesh_shape=list(trainer.mesh_shape), num_devices=trainer.num_devices,
            config_hash=config.config_hash(), fingerprint=fp,
            param_count=sum(s.nbytes // s.dtype.itemsize for s in trainer.leaf_specs),
            device_kind=jax.devices()[0].device_kind, step=trainer.step,
            base_fingerprint=trainer.base_fingerprint, **_accounting(trainer))

    @handler
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

    @handler
    def ProbeLink(self, request: pb.ProbeLinkRequest, context) -> pb.ProbeLinkReply:
        """Time the data plane with the other probing pods, or (measure_encryption) on this host alone
        with CURVE and without (pod_worker/link_probe.py)."""
        if request.protocol_version != protos.PROTOCOL_VERSION:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"protocol version mismatch: controller speaks {request.protocol_version}, "
                               f"this worker speaks {protos.PROTOCOL_VERSION}")
        encrypted = parse_address(self.pod.listener.address)[1] if self.pod.listener else False
        if request.measure_encryption:
            rates = self.pod.measure_encryption(EncryptionProbe.from_request(request), deadline(context))
            return pb.ProbeLinkReply(encrypted=encrypted, curve_bytes_per_s=rates.curve_bytes_per_s,
                                     plain_bytes_per_s=rates.plain_bytes_per_s)
        probe = LinkProbe.from_request(request)
        seconds, sent = self.pod.probe_link(probe, deadline(context), prepare=request.prepare)
        return pb.ProbeLinkReply(seconds=seconds, bytes_sent=sent, encrypted=encrypted)

    @handler
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
