"""The controller's handle on one pod worker: a channel, deadlines on every call, and errors that
name the pod and its address."""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from multipod.controller.cluster.api import PodApi
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from multipod.protos.channels import open_channel

Reply = TypeVar("Reply")


class WorkerError(RuntimeError):
    """A worker could not be reached or refused a request; the message names the pod."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class Verdict(enum.Enum):
    """What one health check found. HUNG and DEAD are told apart by the gRPC status, never by text:
    a hung worker (alive, silent) lets the check's deadline expire; a dead or restarting one
    refuses the connection at once."""
    SERVING = "serving"
    HUNG = "hung"                 # the check's deadline expired
    DEAD = "dead"                 # refused, unavailable or otherwise failed: dead or restarting
    NOT_SERVING = "not serving"   # answered, but not SERVING


@dataclass(frozen=True)
class Probe:
    """One health check's verdict, and a human-readable detail for messages."""
    verdict: Verdict
    detail: str = ""

    @property
    def serving(self) -> bool:
        return self.verdict is Verdict.SERVING


class WorkerClient(PodApi):
    """The PodWorker RPCs (PodApi) to one pod's worker (or, with host_index, to one host of a pod
    of several hosts: controller/cluster/pod_client.py's PodClient holds one per host), each with
    a deadline."""

    def __init__(self, pod_index: int, address: str, host_index: int | None = None):
        self.pod_index = pod_index
        self.host_index = host_index
        self.address = address
        who = "spare" if pod_index < 0 else f"pod {pod_index}"     # a spare is checked before it has a slot
        self.name = f"{who} ({address})" if host_index is None else f"{who} host {host_index} ({address})"
        self.channel = open_channel(address)
        self.stub = pb_grpc.PodWorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    CLOSE_TIMEOUT_S = 5.0

    def close(self) -> None:
        """Close the channel, waiting at most CLOSE_TIMEOUT_S: a Ctrl-C that landed inside grpc's
        call bookkeeping can leave close() waiting for good (seen in tests)."""
        closer = threading.Thread(target=self.channel.close, daemon=True, name=f"close-{self.name}")
        closer.start()
        closer.join(self.CLOSE_TIMEOUT_S)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the worker answers its health check; WorkerError naming it if it does not."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            host = "" if self.host_index is None else f" --host-index {self.host_index}"
            raise WorkerError(f"{self.name} is unreachable: no connection within {timeout_s:g}s "
                              f"(is `multipod worker --pod-index {self.pod_index}{host} --listen {self.address}` "
                              f"running?)",
                              grpc.StatusCode.UNAVAILABLE) from None
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service="multipod.PodWorker"),
                                      timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error("health check", exc) from None
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise WorkerError(f"{self.name} is not serving (health status {reply.status})")

    def wait_serving(self, timeout_s: float, probe_s: float = 5.0) -> None:
        """Wait until the worker answers SERVING, retrying through refused connections and
        restarts (a worker being replaced); WorkerError naming it at the deadline."""
        deadline = time.monotonic() + timeout_s
        why = "never answered"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name} did not serve again within {timeout_s:g}s (last: {why})",
                                  grpc.StatusCode.UNAVAILABLE)
            probe = self.probe(min(probe_s, left))
            if probe.serving:
                return
            why = probe.detail
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _error(self, what: str, exc: grpc.RpcError) -> WorkerError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # Workers answer their own internal waits with ABORTED or FAILED_PRECONDITION, so this
            # code always means that this call's own deadline passed.
            details = f"no answer within the call's deadline ({details})"
        return WorkerError(f"{self.name}: {what} failed: {code.name if code else '?'}: {details}", code)

    # -- the PodWorker RPCs (PodApi): each a blocking call and a started one ----------------------
    def _unary(self, rpc: Any, name: str, request: Message, timeout_s: float) -> Any:
        """A unary call of the stub's `rpc` with a deadline; WorkerError naming the pod and `name`."""
        try:
            return rpc(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error(name, exc) from None

    def _start(self, rpc: Any, name: str, request: Message, timeout_s: float) -> PendingCall[Any]:
        """Start a unary call with a deadline; the PendingCall's result() raises WorkerError."""
        return PendingCall(self, name, rpc.future(request, timeout=timeout_s))

    def configure(self, request: pb.ConfigureRequest, timeout_s: float) -> pb.ConfigureReply:
        return self._unary(self.stub.Configure, "Configure", request, timeout_s)

    def configure_async(self, request: pb.ConfigureRequest, timeout_s: float) -> PendingCall[pb.ConfigureReply]:
        return self._start(self.stub.Configure, "Configure", request, timeout_s)

    def step(self, request: pb.StepRequest, timeout_s: float) -> pb.StepReply:
        return self._unary(self.stub.Step, "Step", request, timeout_s)

    def step_async(self, request: pb.StepRequest, timeout_s: float) -> PendingCall[pb.StepReply]:
        return self._start(self.stub.Step, "Step", request, timeout_s)

    def save(self, request: pb.SaveRequest, timeout_s: float) -> pb.SaveReply:
        return self._unary(self.stub.Save, "Save", request, timeout_s)

    def save_async(self, request: pb.SaveRequest, timeout_s: float) -> PendingCall[pb.SaveReply]:
        return self._start(self.stub.Save, "Save", request, timeout_s)

    def wait_save(self, request: pb.WaitSaveRequest, timeout_s: float) -> pb.SaveReply:
        return self._unary(self.stub.WaitSave, "WaitSave", request, timeout_s)

    def wait_save_async(self, request: pb.WaitSaveRequest, timeout_s: float) -> PendingCall[pb.SaveReply]:
        return self._start(self.stub.WaitSave, "WaitSave", request, timeout_s)

    def restore(self, request: pb.RestoreRequest, timeout_s: float) -> pb.RestoreReply:
        return self._unary(self.stub.Restore, "Restore", request, timeout_s)

    def restore_async(self, request: pb.RestoreRequest, timeout_s: float) -> PendingCall[pb.RestoreReply]:
        return self._start(self.stub.Restore, "Restore", request, timeout_s)

    def evaluate(self, request: pb.EvaluateRequest, timeout_s: float) -> pb.EvaluateReply:
        return self._unary(self.stub.Evaluate, "Evaluate", request, timeout_s)

    def evaluate_async(self, request: pb.EvaluateRequest, timeout_s: float) -> PendingCall[pb.EvaluateReply]:
        return self._start(self.stub.Evaluate, "Evaluate", request, timeout_s)

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> pb.GenerateReply:
        return self._unary(self.stub.Generate, "Generate", request, timeout_s)

    def generate_async(self, request: pb.GenerateRequest, timeout_s: float) -> PendingCall[pb.GenerateReply]:
        return self._start(self.stub.Generate, "Generate", request, timeout_s)

    def generate_stream(self, request: pb.GenerateRequest, timeout_s: float) -> Iterator[pb.GenerateChunk]:
        """GenerateStream with a deadline on the whole stream: its chunks as they come; WorkerError
        naming the pod on failure."""
        try:
            yield from self.stub.GenerateStream(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error("GenerateStream", exc) from None

    def probe_link_async(self, request: pb.ProbeLinkRequest, timeout_s: float) -> PendingCall[pb.ProbeLinkReply]:
        """ProbeLink (`multipod tune --dcn`): every probing pod's call must be under way at once."""
        return self._start(self.stub.ProbeLink, "ProbeLink", request, timeout_s)

    def status(self, timeout_s: float = 5.0) -> pb.StatusReply:
        """The worker's Status reply (configured?, step, state)."""
        return self._unary(self.stub.Status, "Status", pb.StatusRequest(), timeout_s)

    def set_membership(self, request: pb.MembershipRequest, timeout_s: float) -> pb.MembershipReply:
        return self._unary(self.stub.SetMembership, "SetMembership", request, timeout_s)

    def set_membership_async(self, request: pb.MembershipRequest,
                             timeout_s: float) -> PendingCall[pb.MembershipReply]:
        return self._start(self.stub.SetMembership, "SetMembership", request, timeout_s)

    def send_state(self, request: pb.SendStateRequest, timeout_s: float) -> pb.TransferReply:
        return self._unary(self.stub.SendState, "SendState", request, timeout_s)

    def send_state_async(self, request: pb.SendStateRequest, timeout_s: float) -> PendingCall[pb.TransferReply]:
        return self._start(self.stub.SendState, "SendState", request, timeout_s)

    def receive_state(self, request: pb.ReceiveStateRequest, timeout_s: float) -> pb.TransferReply:
        return self._unary(self.stub.ReceiveState, "ReceiveState", request, timeout_s)

    def receive_state_async(self, request: pb.ReceiveStateRequest,
                            timeout_s: float) -> PendingCall[pb.TransferReply]:
        return self._start(self.stub.ReceiveState, "ReceiveState", request, timeout_s)

    def adopt_slot(self, request: pb.AdoptSlotRequest, timeout_s: float) -> pb.AdoptSlotReply:
        return self._unary(self.stub.AdoptSlot, "AdoptSlot", request, timeout_s)

    def adopt_slot_async(self, request: pb.AdoptSlotRequest, timeout_s: float) -> PendingCall[pb.AdoptSlotReply]:
        return self._start(self.stub.AdoptSlot, "AdoptSlot", request, timeout_s)

    def shutdown(self, timeout_s: float) -> pb.ShutdownReply:
        return self._unary(self.stub.Shutdown, "Shutdown", pb.ShutdownRequest(), timeout_s)

    def probe(self, timeout_s: float) -> Probe:
        """One health check with a deadline. HUNG if the deadline expires (alive but silent),
        DEAD if the check is refused or fails, NOT_SERVING if the worker says so."""
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service="multipod.PodWorker"),
                                      timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Probe(Verdict.HUNG, f"no answer to its health check within {timeout_s:g}s (hung or overloaded)")
            return Probe(Verdict.DEAD, f"health check failed: {exc.code().name} (dead or restarting)")
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return Probe(Verdict.NOT_SERVING,
                         f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
        return Probe(Verdict.SERVING)


class PendingCall(Generic[Reply]):
    """An RPC in flight (a Pending); result() raises WorkerError naming the pod."""

    def __init__(self, client: WorkerClient, method: str, future: Any):
        self.client, self.method, self.future = client, method, future

    def result(self) -> Reply:
        # The RPC carries its own deadline, so this wait is bounded by it.
        try:
            return self.future.result()
        except grpc.RpcError as exc:
            raise self.client._error(self.method, exc) from None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the call to finish; True if it has (successfully or not)."""
        try:
            self.future.exception(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            return True
        return True

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        self.future.cancel()
