"""PodApi: the controller's typed interface to one pod, one method per RPC of the PodWorker service
(protos/multipod.proto), each with its request and reply message types.

WorkerClient (controller/cluster/client.py: one worker) and PodClient (pod_client.py: a pod of
several hosts, which fans each call out to its hosts) implement it; the rest of the controller
(Cluster, the step loop, failover, the checkpointer, the evaluator) calls pods only through it,
and the unit tests' fake pods stand in for it. Every unary RPC has a blocking method, `x(request,
timeout_s) -> reply`, and a started one, `x_async(request, timeout_s) -> Pending[reply]`; every
call has a deadline and fails with a WorkerError naming the pod (and host).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:   # client.py implements PodApi, so it imports this module
    from multipod.controller.cluster.client import Probe

Reply_co = TypeVar("Reply_co", covariant=True)


class Pending(Protocol[Reply_co]):
    """An RPC in flight, to one host or to every host of a pod."""

    def result(self) -> Reply_co:
        """The reply, once the call finished; WorkerError naming the pod (and host) if it failed.
        The call carries its deadline, so this wait is bounded by it."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the call to finish; True if it has (successfully or not)."""
        ...

    def done(self) -> bool:
        """Whether the call has finished (successfully or not)."""
        ...

    def cancel(self) -> None:
        """Cancel the call (a finished one stays as it was)."""
        ...


class PodApi(Protocol):
    """One pod as the controller sees it: its name and address, health, and the PodWorker RPCs."""

    pod_index: int
    address: str    # the pod's gRPC address(es): its hosts' joined with ","
    name: str       # "pod P (address)", the prefix of every error about it

    def close(self) -> None:
        """Close the pod's channel(s), without waiting on a stuck one for long."""
        ...

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the pod answers its health check; WorkerError naming it if it does not."""
        ...

    def wait_serving(self, timeout_s: float, probe_s: float = 5.0) -> None:
        """Wait until the pod answers SERVING, through refused connections and restarts."""
        ...

    def probe(self, timeout_s: float) -> Probe:
        """One health check with a deadline: serving, hung, dead or not serving."""
        ...

    # -- the PodWorker service ---------------------------------------------------------------
    def configure(self, request: pb.ConfigureRequest, timeout_s: float) -> pb.ConfigureReply:
        ...

    def configure_async(self, request: pb.ConfigureRequest, timeout_s: float) -> Pending[pb.ConfigureReply]:
        ...

    def step(self, request: pb.StepRequest, timeout_s: float) -> pb.StepReply:
        ...

    def step_async(self, request: pb.StepRequest, timeout_s: float) -> Pending[pb.StepReply]:
        ...

    def save(self, request: pb.SaveRequest, timeout_s: float) -> pb.SaveReply:
        ...

    def save_async(self, request: pb.SaveRequest, timeout_s: float) -> Pending[pb.SaveReply]:
        ...

    def wait_save(self, request: pb.WaitSaveRequest, timeout_s: float) -> pb.SaveReply:
        ...

    def wait_save_async(self, request: pb.WaitSaveRequest, timeout_s: float) -> Pending[pb.SaveReply]:
        ...

    def restore(self, request: pb.RestoreRequest, timeout_s: float) -> pb.RestoreReply:
        ...

    def restore_async(self, request: pb.RestoreRequest, timeout_s: float) -> Pending[pb.RestoreReply]:
        ...

    def evaluate(self, request: pb.EvaluateRequest, timeout_s: float) -> pb.EvaluateReply:
        ...

    def evaluate_async(self, request: pb.EvaluateRequest, timeout_s: float) -> Pending[pb.EvaluateReply]:
        ...

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> pb.GenerateReply:
        ...

    def generate_async(self, request: pb.GenerateRequest, timeout_s: float) -> Pending[pb.GenerateReply]:
        ...

    def generate_stream(self, request: pb.GenerateRequest, timeout_s: float) -> Iterator[pb.GenerateChunk]:
        """GenerateStream: the chunks as they come, the whole stream within timeout_s."""
        ...

    def status(self, timeout_s: float = 5.0) -> pb.StatusReply:
        """Status: configured?, step, state, the data-plane address."""
        ...

    def set_membership(self, request: pb.MembershipRequest, timeout_s: float) -> pb.MembershipReply:
        ...

    def set_membership_async(self, request: pb.MembershipRequest,
                             timeout_s: float) -> Pending[pb.MembershipReply]:
        ...

    def send_state(self, request: pb.SendStateRequest, timeout_s: float) -> pb.TransferReply:
        ...

    def send_state_async(self, request: pb.SendStateRequest, timeout_s: float) -> Pending[pb.TransferReply]:
        ...

    def receive_state(self, request: pb.ReceiveStateRequest, timeout_s: float) -> pb.TransferReply:
        ...

    def receive_state_async(self, request: pb.ReceiveStateRequest,
                            timeout_s: float) -> Pending[pb.TransferReply]:
        ...

    def adopt_slot(self, request: pb.AdoptSlotRequest, timeout_s: float) -> pb.AdoptSlotReply:
        """DiLoCo "replay": host a failed pod's replica."""
        ...

    def adopt_slot_async(self, request: pb.AdoptSlotRequest, timeout_s: float) -> Pending[pb.AdoptSlotReply]:
        ...

    def shutdown(self, timeout_s: float) -> pb.ShutdownReply:
        ...
