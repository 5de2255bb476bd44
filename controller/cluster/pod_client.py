"""Pods of several hosts, as the controller sees them.

A pod of K hosts runs one worker per host; together they form one jax.distributed cluster and run
the pod's step as one SPMD program. So every RPC that runs a computation goes to all K hosts at
once. PodClient wraps the K hosts' WorkerClients behind the PodApi interface (api.py) the rest
of the controller uses (Cluster, the step loop, failover, the checkpointer), one method per RPC,
and keeps the hosts' differences in one place:

  * Step: host h gets row block h of the pod's shard (and of every extra shard, and of their
    loss masks);
  * Configure: host h gets host_index=h, hosts_per_pod=K and host h's data-plane address of
    every pod (hosts exchange host to host);
  * SendState: host h streams to host h of the receiving pod;
  * Status: the hosts must agree on the pod's layout; the pod's dcn_address lists its hosts'
    data-plane addresses joined with "|" (one string per pod, as for a single-host pod);
  * probe: the worst host's verdict, naming that host;
  * GenerateStream: host 0's chunks (the other hosts' streams are read alongside).

Every other request goes to every host unchanged. A call succeeds only if every host's does, and
answers with host 0's reply. The pods' host lists (`--workers`) are read by addresses.py.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import grpc
from google.protobuf.message import Message

from multipod.controller.cluster.api import Pending, PodApi
from multipod.controller.cluster.client import Probe, Verdict, WorkerClient, WorkerError
from multipod.controller.core.errors import RunError
from multipod.model.config import ConfigError
from multipod.protos import codec, multipod_pb2 as pb

DCN_SEPARATOR = "|"     # between the hosts' data-plane addresses in a pod's StatusReply.dcn_address
POLL_S = 0.05           # how often a combined call looks at its other hosts while it waits on one

# Worst first: a hung host gets its pod killed and restarted (a dead one is restarted by its
# supervisor anyway); a pod with any host not serving is not serving.
_SEVERITY = {Verdict.HUNG: 3, Verdict.DEAD: 2, Verdict.NOT_SERVING: 1, Verdict.SERVING: 0}

Req = TypeVar("Req", bound=Message)
Reply = TypeVar("Reply")
Out = TypeVar("Out")


def make_pod_client(pod_index: int, addresses: list[str]) -> PodApi:
    """A plain WorkerClient for a one-host pod (exactly as before multi-host pods), a PodClient
    over one WorkerClient per host otherwise."""
    if len(addresses) == 1:
        return WorkerClient(pod_index, addresses[0])
    return PodClient(pod_index, [WorkerClient(pod_index, a, host_index=h) for h, a in enumerate(addresses)])


def _split_rows(payload: bytes, hosts: int, what: str) -> list[bytes]:
    tokens = codec.decode(payload)
    if tokens.ndim < 1 or tokens.shape[0] % hosts:
        raise ConfigError("data.global_batch", f"{what} has {tokens.shape[0] if tokens.ndim else 0} rows, which do "
                          f"not split into {hosts} equal blocks, one per host: the rows per pod "
                          f"(data.global_batch / pods) must be a multiple of the hosts per pod ({hosts})")
    block = tokens.shape[0] // hosts
    return [codec.encode(tokens[h * block:(h + 1) * block]) for h in range(hosts)]


def _host_part(address: str, host: int, hosts: int, what: str) -> str:
    parts = address.split(DCN_SEPARATOR)
    if len(parts) != hosts:
        raise RunError(f"{what} {address!r} lists {len(parts)} host(s), but the pod has {hosts}: every pod must "
                       f"have the same number of hosts")
    return parts[host]


def _copies(request: Req, k: int) -> list[Req]:
    """k copies of a request message, one per host, each to be changed on its own."""
    out = []
    for _ in range(k):
        copy = type(request)()
        copy.CopyFrom(request)
        out.append(copy)
    return out


class PodCall(Generic[Reply]):
    """The K hosts' calls of one RPC, as one Pending: done once every host's call finished or
    one failed; result() is host 0's reply, or the first failure seen (a WorkerError naming the
    host). A failed host does not cancel the others (they end by their own deadline, or when the
    pod is reset); cancel() cancels them all."""

    def __init__(self, pod: PodClient, method: str, calls: list[Pending[Reply]]):
        self.pod, self.method, self.calls = pod, method, calls
        self._failures: list[tuple[int, Exception]] = []    # in the order they were seen

    def _scan(self) -> None:
        known = {h for h, _ in self._failures}
        for h, call in enumerate(self.calls):
            if h in known or not call.done():
                continue
            try:
                call.result()
            except WorkerError as exc:
                self._failures.append((h, exc))
            except Exception as exc:    # e.g. the call was cancelled
                self._failures.append((h, WorkerError(f"{self.pod.hosts[h].name}: {self.method} failed: {exc!r}")))

    def done(self) -> bool:
        self._scan()
        return bool(self._failures) or all(call.done() for call in self.calls)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for every host to finish, or one to fail; True if so."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.done():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # The calls that were still running when done() looked may all have finished since.
            pending = next((call for call in self.calls if not call.done()), None)
            if pending is not None:
                pending.wait(min(POLL_S, left))

    def result(self) -> Reply:
        self._scan()
        if self._failures:
            raise self._failures[0][1]
        replies = [call.result() for call in self.calls]
        return replies[0]

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


class PodClient(PodApi):
    """One pod of several hosts behind the PodApi interface of one worker. `hosts`: one PodApi
    per host (WorkerClients, with a host_index), in host order, each with a name that says which
    host it is."""

    def __init__(self, pod_index: int, hosts: Sequence[PodApi]):
        if len(hosts) < 2:
            raise ValueError("a PodClient needs at least two hosts (use a WorkerClient for one)")
        self.pod_index = pod_index
        self.hosts = list(hosts)
        self.address = ",".join(h.address for h in self.hosts)
        self.name = f"{'spare' if pod_index < 0 else f'pod {pod_index}'} ({self.address})"

    @property
    def hosts_per_pod(self) -> int:
        return len(self.hosts)

    def _each(self, fn: Callable[[PodApi], Out]) -> list[Out]:
        """fn(host) on every host in parallel; the results in host order. The first error (in
        host order) is raised once every host has answered: each call has its own deadline."""
        with concurrent.futures.ThreadPoolExecutor(len(self.hosts)) as pool:
            futures = [pool.submit(fn, host) for host in self.hosts]
            concurrent.futures.wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]

    def close(self) -> None:
        for host in self.hosts:
            host.close()

    def wait_ready(self, timeout_s: float) -> None:
        self._each(lambda host: host.wait_ready(timeout_s))

    def wait_serving(self, timeout_s: float, probe_s: float = 5.0) -> None:
        self._each(lambda host: host.wait_serving(timeout_s, probe_s))

    # -- what each host gets (see the module's docstring) ---------------------------------------
    def step_requests(self, request: pb.StepRequest) -> list[pb.StepRequest]:
        """Host h's copy of a Step request: row block h of the pod's shard and of every extra one
        (and of their loss masks, a prompt-tuning run's). ConfigError naming data.global_batch if
        the rows do not split over the hosts."""
        k = len(self.hosts)

        def blocks(shard: pb.StepRequest | pb.Shard, what: str) -> tuple[list[bytes], list[bytes] | None]:
            masks = _split_rows(shard.loss_mask, k, f"the loss mask of {what}") if shard.loss_mask else None
            return _split_rows(shard.tokens, k, what), masks
        own = blocks(request, f"{self.name}'s shard")
        extra = [blocks(s, f"the shard of slot {s.slot} (computed by {self.name})") for s in request.extra_shards]
        out = _copies(request, k)
        for h, copy in enumerate(out):
            shards: list[pb.StepRequest | pb.Shard] = [copy, *copy.extra_shards]   # each with tokens, loss_mask
            for shard, (tokens, masks) in zip(shards, [own, *extra]):
                shard.tokens = tokens[h]
                if masks is not None:
                    shard.loss_mask = masks[h]
        return out

    def configure_requests(self, request: pb.ConfigureRequest) -> list[pb.ConfigureRequest]:
        """Host h's copy of a Configure request: its host index, the host count and host h's
        data-plane address of every pod."""
        k = len(self.hosts)
        out = _copies(request, k)
        for h, copy in enumerate(out):
            copy.host_index, copy.hosts_per_pod = h, k
            del copy.dcn_addresses[:]
            copy.dcn_addresses.extend(_host_part(a, h, k, f"pod {p}'s data-plane address")
                                      for p, a in enumerate(request.dcn_addresses))
        return out

    def send_state_requests(self, request: pb.SendStateRequest) -> list[pb.SendStateRequest]:
        """Host h's copy of a SendState request: to host h of the receiving pod."""
        k = len(self.hosts)
        out = _copies(request, k)
        for h, copy in enumerate(out):
            copy.to_address = _host_part(request.to_address, h, k, f"pod {request.to_pod}'s data-plane address")
        return out

    def _same(self, request: Req) -> list[Req]:
        return [request] * len(self.hosts)

    # -- one call on every host -----------------------------------------------------------------
    def _start(self, method: str, requests: list[Req],
               start: Callable[[PodApi, Req], Pending[Reply]]) -> PodCall[Reply]:
        """start(host, its request) on every host; the PodCall's result() raises WorkerError naming
        a host. If a host's call cannot be started, the ones already started are cancelled."""
        calls: list[Pending[Reply]] = []
        try:
            for host, host_request in zip(self.hosts, requests):
                calls.append(start(host, host_request))
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        return PodCall(self, method, calls)

    def _finish(self, pending: PodCall[Reply], timeout_s: float) -> Reply:
        """Wait for a started call: host 0's reply if every host succeeds, else the first failure
        (WorkerError naming the host)."""
        # Each host's call carries the deadline; the margin only covers the callbacks' latency.
        if not pending.wait(timeout_s + 5.0):
            pending.cancel()
            late = [self.hosts[h].name for h, call in enumerate(pending.calls) if not call.done()]
            raise WorkerError(f"{', '.join(late)}: {pending.method} failed: no answer within the call's deadline",
                              grpc.StatusCode.DEADLINE_EXCEEDED)
        return pending.result()

    def configure_async(self, request: pb.ConfigureRequest, timeout_s: float) -> PodCall[pb.ConfigureReply]:
        return self._start("Configure", self.configure_requests(request),
                           lambda host, r: host.configure_async(r, timeout_s))

    def configure(self, request: pb.ConfigureRequest, timeout_s: float) -> pb.ConfigureReply:
        return self._finish(self.configure_async(request, timeout_s), timeout_s)

    def step_async(self, request: pb.StepRequest, timeout_s: float) -> PodCall[pb.StepReply]:
        return self._start("Step", self.step_requests(request), lambda host, r: host.step_async(r, timeout_s))

    def step(self, request: pb.StepRequest, timeout_s: float) -> pb.StepReply:
        return self._finish(self.step_async(request, timeout_s), timeout_s)

    def save_async(self, request: pb.SaveRequest, timeout_s: float) -> PodCall[pb.SaveReply]:
        return self._start("Save", self._same(request), lambda host, r: host.save_async(r, timeout_s))

    def save(self, request: pb.SaveRequest, timeout_s: float) -> pb.SaveReply:
        return self._finish(self.save_async(request, timeout_s), timeout_s)

    def wait_save_async(self, request: pb.WaitSaveRequest, timeout_s: float) -> PodCall[pb.SaveReply]:
        return self._start("WaitSave", self._same(request), lambda host, r: host.wait_save_async(r, timeout_s))

    def wait_save(self, request: pb.WaitSaveRequest, timeout_s: float) -> pb.SaveReply:
        return self._finish(self.wait_save_async(request, timeout_s), timeout_s)

    def restore_async(self, request: pb.RestoreRequest, timeout_s: float) -> PodCall[pb.RestoreReply]:
        return self._start("Restore", self._same(request), lambda host, r: host.restore_async(r, timeout_s))

    def restore(self, request: pb.RestoreRequest, timeout_s: float) -> pb.RestoreReply:
        return self._finish(self.restore_async(request, timeout_s), timeout_s)

    def evaluate_async(self, request: pb.EvaluateRequest, timeout_s: float) -> PodCall[pb.EvaluateReply]:
        return self._start("Evaluate", self._same(request), lambda host, r: host.evaluate_async(r, timeout_s))

    def evaluate(self, request: pb.EvaluateRequest, timeout_s: float) -> pb.EvaluateReply:
        return self._finish(self.evaluate_async(request, timeout_s), timeout_s)

    def generate_async(self, request: pb.GenerateRequest, timeout_s: float) -> PodCall[pb.GenerateReply]:
        return self._start("Generate", self._same(request), lambda host, r: host.generate_async(r, timeout_s))

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> pb.GenerateReply:
        return self._finish(self.generate_async(request, timeout_s), timeout_s)

    def generate_stream(self, request: pb.GenerateRequest, timeout_s: float) -> Iterator[pb.GenerateChunk]:
        """The stream on every host at once (the hosts run the generation together): host 0's
        chunks as they come, the others' read alongside; then the first failure in host order
        (a WorkerError naming the host), if any."""
        def drain(host: PodApi) -> None:
            for _ in host.generate_stream(request, timeout_s):
                pass

        with concurrent.futures.ThreadPoolExecutor(len(self.hosts) - 1) as pool:
            others = [pool.submit(drain, host) for host in self.hosts[1:]]
            yield from self.hosts[0].generate_stream(request, timeout_s)
            for other in others:
                other.result()

    def set_membership_async(self, request: pb.MembershipRequest,
                             timeout_s: float) -> PodCall[pb.MembershipReply]:
        return self._start("SetMembership", self._same(request),
                           lambda host, r: host.set_membership_async(r, timeout_s))

    def set_membership(self, request: pb.MembershipRequest, timeout_s: float) -> pb.MembershipReply:
        return self._finish(self.set_membership_async(request, timeout_s), timeout_s)

    def send_state_async(self, request: pb.SendStateRequest, timeout_s: float) -> PodCall[pb.TransferReply]:
        return self._start("SendState", self.send_state_requests(request),
                           lambda host, r: host.send_state_async(r, timeout_s))

    def adopt_slot_async(self, request: pb.AdoptSlotRequest, timeout_s: float) -> PodCall[pb.AdoptSlotReply]:
        # Every host retakes the inner steps together (each puts its row block of the shards).
        return self._start("AdoptSlot", self._same(request), lambda host, r: host.adopt_slot_async(r, timeout_s))

    def adopt_slot(self, request: pb.AdoptSlotRequest, timeout_s: float) -> pb.AdoptSlotReply:
        return self._finish(self.adopt_slot_async(request, timeout_s), timeout_s)

    def send_state(self, request: pb.SendStateRequest, timeout_s: float) -> pb.TransferReply:
        return self._finish(self.send_state_async(request, timeout_s), timeout_s)

    def receive_state_async(self, request: pb.ReceiveStateRequest,
                            timeout_s: float) -> PodCall[pb.TransferReply]:
        return self._start("ReceiveState", self._same(request),
                           lambda host, r: host.receive_state_async(r, timeout_s))

    def receive_state(self, request: pb.ReceiveStateRequest, timeout_s: float) -> pb.TransferReply:
        return self._finish(self.receive_state_async(request, timeout_s), timeout_s)

    def shutdown(self, timeout_s: float) -> pb.ShutdownReply:
        """Shutdown on every host at once; host 0's reply, or the first failure in host order."""
        return self._each(lambda host: host.shutdown(timeout_s))[0]

    def status(self, timeout_s: float = 5.0) -> pb.StatusReply:
        """Host 0's Status, with the pod's data-plane addresses (every host's, joined with "|") and
        configured only if every host is. RunError naming the host if the hosts disagree on the
        pod's layout (host count, host index, pod, coordinator, device count)."""
        replies = self._each(lambda host: host.status(timeout_s))
        self.check_layout(replies)
        reply = pb.StatusReply()
        reply.CopyFrom(replies[0])
        reply.dcn_address = DCN_SEPARATOR.join(r.dcn_address for r in replies)
        reply.configured = all(r.configured for r in replies)
        return reply

    def check_layout(self, replies: list[pb.StatusReply]) -> None:
        """RunError naming the host whose Status does not fit the pod as --workers lists it."""
        k, hosts = len(self.hosts), self.hosts
        for host, r in zip(hosts, replies):
            if r.hosts_per_pod != k:
                raise RunError(f"{host.name} runs with --hosts-per-pod {r.hosts_per_pod or 1}, but --workers lists "
                               f"{k} hosts for pod {self.pod_index}: start every host of the pod with "
                               f"--hosts-per-pod {k}")
            if r.pod_index != self.pod_index and not r.spare:     # a spare takes the index it is given
                raise RunError(f"{host.name} serves pod {r.pod_index} (--pod-index {r.pod_index}), but --workers "
                               f"lists it in pod {self.pod_index}")
        for h, (host, r) in enumerate(zip(hosts, replies)):
            if r.host_index >= k:
                raise RunError(f"{host.name} runs with --host-index {r.host_index}, out of range for the pod's "
                               f"{k} hosts (0..{k - 1})")
            twin = next((o for o in range(h) if replies[o].host_index == r.host_index), None)
            if twin is not None:
                raise RunError(f"{hosts[twin].name} and {host.name} both claim host index {r.host_index} of "
                               f"pod {self.pod_index}: give each host of a pod its own --host-index")
        for h, (host, r) in enumerate(zip(hosts, replies)):
            if r.host_index != h:
                raise RunError(f"{host.name} runs with --host-index {r.host_index}, but --workers lists it as "
                               f"host {h} of pod {self.pod_index}: list a pod's hosts in host-index order")
        for what, get in (("the pod's coordinator (--pod-coordinator)", lambda r: r.pod_coordinator),
                          ("the device count per host", lambda r: r.local_devices)):
            for host, r in zip(hosts[1:], replies[1:]):
                if get(r) != get(replies[0]):
                    raise RunError(f"the hosts of pod {self.pod_index} disagree on {what}: {host.name} has "
                                   f"{get(r)!r}, {hosts[0].name} has {get(replies[0])!r}")

    def probe(self, timeout_s: float) -> Probe:
        """Every host's health check at once; the worst verdict (hung, then dead, then not
        serving), its detail naming the host(s)."""
        probes = self._each(lambda host: host.probe(timeout_s))
        worst = max(probes, key=lambda p: _SEVERITY[p.verdict])
        if worst.serving:
            return worst
        detail = "; ".join(f"{host.name}: {p.detail}" for host, p in zip(self.hosts, probes)
                           if p.verdict is worst.verdict)
        return Probe(worst.verdict, detail)
