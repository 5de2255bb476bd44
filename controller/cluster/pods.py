"""The pods as one cluster: connect, configure (and check that the pods agree), the watchdog, and
the diagnosis that names failed pods. Everything here talks to the pods through the typed PodApi
interface (api.py: WorkerClient, PodClient), so tests can pass fakes."""
from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from multipod import protos
from multipod.controller.cluster.addresses import pod_hosts
from multipod.controller.cluster.api import PodApi
from multipod.controller.cluster.client import Probe, Verdict, WorkerError
from multipod.controller.cluster.pod_client import make_pod_client
from multipod.controller.cluster.spares import Spare
from multipod.controller.core.errors import PodFailure, RunError
from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.controller.cluster.compile_marks import CompileMarks
    from multipod.controller.core.run_config import Config

# What the pods must agree on. A freshly configured pod starts from the seed's initial state,
# so a restarted pod's step and fingerprint are compared with a survivor's first reply as well
# (unless the run reattached to pods mid-run: their first replies hold that state, not the seed's).
STATIC_AGREEMENT = (("protocol version", lambda r: r.protocol_version),
                    ("mesh shape (data, model)", lambda r: tuple(r.mesh_shape)),
                    ("device count", lambda r: r.num_devices),
                    ("config hash", lambda r: r.config_hash),
                    # prompt tuning: every pod must hold the very same frozen base
                    ("base model fingerprint", lambda r: r.base_fingerprint))
# The pod index a spare is spoken to with before it has a slot (its Status says -1).
SPARE_INDEX = -1
AGREEMENT = STATIC_AGREEMENT + (("initial step", lambda r: r.step),
                                ("initial state fingerprint", lambda r: r.fingerprint))


def parallel(fn, items):
    """Run fn over items in threads; return results in order, raising the first error (or a
    RunError listing all of them if several failed)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        errors, results = [], []
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


def failure_from_probes(clients, probes: list[Probe], bad: list[int], context: str = "") -> PodFailure:
    """A PodFailure naming the pods in `bad` with their verdicts; hung ones are told by the enum."""
    message = "; ".join(f"{clients[i].name} is not responding: {probes[i].detail}" for i in bad)
    if context:
        message = f"{message} ({context})" if message else context
    return PodFailure(message, [clients[i].pod_index for i in bad],
                      [clients[i].pod_index for i in bad if probes[i].verdict is Verdict.HUNG])


class Watchdog:
    """Probes every pod's health service on a background thread; a pod that misses `misses`
    checks in a row (each with its own deadline) is reported by name in `failure`."""

    def __init__(self, clients, interval_s: float, timeout_s: float, misses: int = 2):
        self.clients, self.interval_s, self.timeout_s, self.misses = clients, interval_s, timeout_s, misses
        self.failure: PodFailure | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="watchdog")
        self._thread.start()

    def _run(self) -> None:
        missed = [0] * len(self.clients)
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            while not self._stop.wait(self.interval_s):
                probes = list(pool.map(lambda c: c.probe(self.timeout_s), self.clients))
                if self._stop.is_set():
                    return
                for i, probe in enumerate(probes):
                    missed[i] = 0 if probe.serving else missed[i] + 1
                bad = [i for i in range(len(self.clients)) if missed[i] >= self.misses]
                if bad:   # one miss is forgiven: a busy pod may answer one check late
                    self.failure = failure_from_probes(self.clients, probes, bad)
                    return

    def stop(self) -> None:
        """Stop probing (the thread ends after its current round)."""
        self._stop.set()


class Cluster:
    """The run's pods: their clients, the replies of the first configure (the reference a
    restarted pod must match), the run id under which their DCN links are set up (a new
    generation after every restore or membership change, so stale links are never mixed with new
    ones), and in degraded mode which pod computes which slot's shard (`hosts`)."""

    def __init__(self, clients: list[PodApi], config: Config, generation_only: bool = False):
        self.clients = clients
        self.config = config
        # The pods will only generate (`multipod generate`): they do not compile the training step.
        self.generation_only = generation_only
        self.base_run_id = uuid.uuid4().hex
        self.generation = 0
        self.first_replies: list[pb.ConfigureReply] | None = None
        self.fresh_reference = True            # first_replies hold the seed's initial state
        self.dcn_addresses: list[str] = []     # every pod's data-plane endpoint (StatusReply.dcn_address)
        self.hosts: list[int] = list(range(len(clients)))   # hosts[slot]: the pod computing slot's shard
        self.pids: dict[int, int] = {}         # each pod's process when configured (Status.pid)
        self.device_counts: list[int] = []     # each pod's device count as its Status reports it

    @property
    def size(self) -> int:
        """The number of pods the run was configured for (= shards per global batch)."""
        return len(self.clients)

    @property
    def live(self) -> list[int]:
        """The pods taking part in the steps (all of them unless degraded)."""
        return sorted(set(self.hosts))

    @property
    def live_clients(self) -> list[PodApi]:
        return [self.clients[p] for p in self.live]

    @property
    def degraded(self) -> bool:
        return len(self.live) < self.size

    def set_membership(self, pods: list[int], timeout_s: float) -> list[pb.MembershipReply]:
        """Give `pods` the current hosts under a new run id (a step stuck in an old exchange
        fails at once); their replies, in the order of `pods`."""
        run_id = self.next_generation()
        hosts = [] if not self.degraded else list(self.hosts)
        # Every pod's data-plane endpoint each time: a slot hot-swapped to a spare has a new one.
        dcn = list(self.dcn_addresses) if self.size > 1 and len(self.dcn_addresses) == self.size else []
        request = pb.MembershipRequest(run_id=run_id, hosts=hosts, num_pods=self.size, dcn_addresses=dcn)
        return parallel(lambda p: self.clients[p].set_membership(request, timeout_s), pods)

    def transfer_state(self, donor: int, receiver: int, timeout_s: float) -> tuple[pb.TransferReply, pb.TransferReply]:
        """Stream `donor`'s state to `receiver` over the data plane; (sent, received) replies.
        RunError if the receiver's verified fingerprint is not the donor's."""
        transfer_id = f"{self.run_id}.transfer.{donor}.{receiver}.{uuid.uuid4().hex[:8]}"
        receive = self.clients[receiver].receive_state_async(
            pb.ReceiveStateRequest(transfer_id=transfer_id, from_pod=donor), timeout_s)
        try:
            sent = self.clients[donor].send_state(pb.SendStateRequest(
                transfer_id=transfer_id, to_pod=receiver, to_address=self.dcn_addresses[receiver]), timeout_s)
        except BaseException:
            receive.cancel()
            raise
        if not receive.wait(timeout_s):
            receive.cancel()
            raise RunError(f"{self.clients[receiver].name} did not confirm the state transfer within {timeout_s:g}s")
        got = receive.result()
        if (got.step, got.fingerprint) != (sent.step, sent.fingerprint):
            raise RunError(f"state transfer {self.clients[donor].name} -> {self.clients[receiver].name}: received "
                           f"step {got.step} ({got.fingerprint}), sent step {sent.step} ({sent.fingerprint})")
        return sent, got

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates (eval.batches > 0): the pods then compile the evaluation at configure."""
        return self.config.eval.batches > 0

    @property
    def run_id(self) -> str:
        return f"{self.base_run_id}.{self.generation}"

    def next_generation(self) -> str:
        """A new run id for the pods' DCN links (before every restore)."""
        self.generation += 1
        return self.run_id

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def collect_dcn_addresses(self) -> list[str]:
        """Ask every pod (Status) where its data plane listens (and note its process, to tell a
        restarted one later)."""
        timeout = self.config.health.timeout_s
        statuses = parallel(lambda c: c.status(timeout), self.clients)
        self.pids = {c.pod_index: s.pid for c, s in zip(self.clients, statuses)}
        self.device_counts = [s.num_devices for s in statuses]
        return [s.dcn_address for s in statuses]

    def restarted(self, pods: list[int]) -> dict[int, str]:
        """Those of `pods` that serve but were restarted since they were configured (another
        process, or not configured): a restart quicker than the watchdog's two missed checks
        still counts as a failure. {pod: why}"""
        timeout = self.config.health.timeout_s
        found = {}
        for pod in pods:
            try:
                status = self.clients[pod].status(timeout)
            except Exception:   # noqa: BLE001 - not answering is the probes' business
                continue
            known = self.pids.get(pod)
            if not status.configured:
                found[pod] = "restarted: it is not configured"
            elif known is not None and status.pid != known:
                found[pod] = f"restarted (process {known} is now {status.pid})"
        return found

    def _configure(self, targets: list[PodApi], keep_state: bool = False,
                   awaits_state: bool = False) -> list[pb.ConfigureReply]:
        addresses = [c.address for c in self.clients]
        worker_json = self.config.worker_config().to_json()
        request = lambda c: pb.ConfigureRequest(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=c.pod_index, num_pods=len(self.clients),
            peer_addresses=addresses, worker_config_json=worker_json, run_id=self.run_id,
            dcn_addresses=self.dcn_addresses, keep_state=keep_state, evaluates=self.evaluates,
            generation_only=self.generation_only, awaits_state=awaits_state)
        timeout = self.config.run.configure_timeout_s
        return parallel(lambda c: c.configure(request(c), timeout), targets)

    def configure(self, shared_cache: CompileMarks | None = None,
                  announce: Callable[[bool], None] | None = None,
                  awaits_state: bool = False) -> list[pb.ConfigureReply]:
        """Configure every pod and refuse pods that disagree on protocol, mesh, config or state;
        the replies are kept as the reference for pods restarted later. shared_cache: the marks
        of the one persistent compilation cache the pods share (pods on one machine, as
        `multipod local` starts them, cluster/compile_marks.py): unless it holds this
        configuration's programs, pod 0 configures first and the others then load its programs
        instead of compiling the same ones at the same time. announce(at_once) is called once the
        order is known, before any pod compiles. awaits_state: the pods' state will come from a
        Restore (a resumed run, generation), so they build no initial state to replace
        (ConfigureRequest.awaits_state); a pod restarted later is then held to the static agreement
        only (there is no initial state to compare)."""
        from multipod.controller.core.run_config import ConfigError
        self.dcn_addresses = self.collect_dcn_addresses()
        # Told before any pod compiles: the same config on other device counts gives other meshes.
        if len(set(self.device_counts)) > 1:
            detail = ", ".join(f"{c.name} has {n}" for c, n in zip(self.clients, self.device_counts))
            raise RunError(f"pods disagree on device count, so on mesh shape: {detail}. Every pod must run "
                           f"the same multipod version with the same device count and mesh.")
        # One pod has no order to choose; its programs need no mark.
        marks = shared_cache if len(self.clients) > 1 else None
        mark = lambda initial_state: "" if marks is None else marks.key(     # noqa: E731
            self.config.worker_config().to_json(), len(self.clients), self.device_counts, self.hosts_per_pod,
            self.evaluates, initial_state)
        # Pods that build no initial state need a subset of the programs of pods that do.
        at_once = marks is None or marks.holds(mark(not awaits_state)) or (awaits_state and marks.holds(mark(True)))
        if announce is not None:
            announce(at_once)
        if at_once:
            replies = self._configure(self.clients, awaits_state=awaits_state)
        else:
            replies = self._configure(self.clients[:1], awaits_state=awaits_state) + \
                self._configure(self.clients[1:], awaits_state=awaits_state)
        for what, get in AGREEMENT:
            values = [get(r) for r in replies]
            if len(set(values)) > 1:
                detail = ", ".join(f"{c.name} has {v}" for c, v in zip(self.clients, values))
                raise RunError(f"pods disagree on {what}: {detail}. Every pod must run the same "
                               f"multipod version with the same device count and mesh.")
        data_axis = replies[0].mesh_shape[0]
        global_batch = self.config.data.global_batch
        per_pod = global_batch // len(self.clients)
        if per_pod % data_axis:
            raise ConfigError("data.global_batch", f"{global_batch} split over {len(self.clients)} pods gives "
                              f"{per_pod} rows per pod, not a multiple of the data axis ({data_axis})")
        self.first_replies, self.fresh_reference = list(replies), not awaits_state
        if marks is not None:
            marks.add(mark(not awaits_state))
        return replies

    def configure_restarted(self, pods: list[int]) -> list[pb.ConfigureReply]:
        """Configure the restarted (or hot-swapped) `pods` and refuse them (RunError naming them)
        unless their replies match the first reply of a pod that stayed up (pod 0's if none did).
        A pod may now listen at another data-plane address: the others learn it with the next
        membership (set_membership)."""
        if self.first_replies is None:
            raise RunError("configure_restarted before the first configure")
        targets = [c for c in self.clients if c.pod_index in pods]
        timeout = self.config.health.timeout_s
        statuses = parallel(lambda c: c.status(timeout), targets)
        addresses = list(self.dcn_addresses)
        for client, status in zip(targets, statuses):
            addresses[client.pod_index] = status.dcn_address
            self.pids[client.pod_index] = status.pid
        self.dcn_addresses = addresses
        replies = self._configure(targets)
        survivors = [c.pod_index for c in self.clients if c.pod_index not in pods]
        ref_pod = survivors[0] if survivors else 0
        reference, ref_name = self.first_replies[ref_pod], self.clients[ref_pod].name
        for what, get in AGREEMENT if self.fresh_reference else STATIC_AGREEMENT:
            bad = [(c, get(r)) for c, r in zip(targets, replies) if get(r) != get(reference)]
            if bad:
                detail = ", ".join(f"{c.name} has {v}" for c, v in bad)
                raise RunError(f"restarted pod(s) disagree with {ref_name}"
                               f"{' (which stayed up)' if survivors else ''} on {what}: {detail}, "
                               f"{ref_name} has {get(reference)}. A restarted worker must run the same "
                               f"multipod version with the same device count and mesh.")
        return replies

    @property
    def hosts_per_pod(self) -> int:
        """The hosts of each pod (the same for every pod: connect checks it)."""
        return len(getattr(self.clients[0], "hosts", [None]))

    def check_spare(self, spare: Spare) -> None:
        """RunError (or WorkerError: unreachable, or refusing the run's secret) naming `spare` if
        it cannot take a slot of this run: it must be a spare (worker --spare) not configured yet,
        with the run's number of hosts per pod and devices per pod."""
        config = self.config
        client = spare.client(SPARE_INDEX)
        try:
            client.wait_ready(config.run.connect_timeout_s)
            status = client.status(config.health.timeout_s)
        except WorkerError as exc:
            raise RunError(f"spare {spare.name} cannot take a slot: {exc}") from None
        finally:
            client.close()
        self._check_spare_status(spare, status)

    def prepare_spare(self, spare: Spare) -> None:
        """Have a checked spare compile the run's programs on standby (it stays a spare; taking a
        slot later costs no compile). RunError naming it if that fails."""
        client = spare.client(SPARE_INDEX)
        request = pb.ConfigureRequest(
            protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=self.size,
            peer_addresses=[c.address for c in self.clients], worker_config_json=self.config.worker_config().to_json(),
            run_id=f"{self.base_run_id}.standby", dcn_addresses=self.dcn_addresses, standby=True,
            evaluates=self.evaluates)
        try:
            client.configure(request, self.config.run.configure_timeout_s)
        except WorkerError as exc:
            raise RunError(f"spare {spare.name} could not compile the run's programs: {exc}") from None
        finally:
            client.close()

    def _check_spare_status(self, spare: Spare, status: pb.StatusReply) -> None:
        why = ""
        if status.protocol_version != protos.PROTOCOL_VERSION:
            why = f"it speaks protocol {status.protocol_version}, the run {protos.PROTOCOL_VERSION}"
        elif not status.spare:
            why = f"it serves pod {status.pod_index} already (start a standby worker with --spare)"
        elif status.configured:
            why = "it is configured already (another run took it)"
        elif len(spare.hosts) != self.hosts_per_pod:
            why = f"it has {len(spare.hosts)} host(s), the run's pods have {self.hosts_per_pod}"
        elif self.device_counts and status.num_devices != self.device_counts[0]:
            why = f"it has {status.num_devices} device(s), the run's pods have {self.device_counts[0]}"
        if why:
            raise RunError(f"spare {spare.name} cannot take a slot: {why}")

    def swap_in(self, slot: int, spare: Spare) -> str:
        """Hand the failed pod's `slot` to `spare` (checked again first): the slot's client speaks
        to the spare from now on (configure_restarted configures it). Returns the slot's old
        address. RunError or WorkerError if the spare does not fit (the slot keeps its client)."""
        client = spare.client(slot)
        try:
            status = client.status(self.config.health.timeout_s)
            self._check_spare_status(spare, status)
        except BaseException:
            client.close()
            raise
        old = self.clients[slot]
        clients = list(self.clients)      # a new list: other threads may be iterating the old one
        clients[slot] = client
        self.clients = clients
        old.close()
        return old.address

    def probe_all(self) -> list[Probe]:
        """One health check of every live pod, in parallel, each with the health deadline."""
        timeout = self.config.health.timeout_s
        return parallel(lambda c: c.probe(timeout), self.live_clients)

    def diagnose(self, message: str, suspects: list[int] = ()) -> PodFailure:
        """Probe every live pod and name the ones that do not answer, with `message` as context;
        if all answer, the `suspects` (pods whose step failed for a reason of their own)."""
        probes = self.probe_all()
        clients = self.live_clients
        restarted = self.restarted([c.pod_index for c, p in zip(clients, probes) if p.serving])
        probes = [Probe(Verdict.DEAD, restarted[c.pod_index]) if c.pod_index in restarted else p
                  for c, p in zip(clients, probes)]
        bad = [i for i, probe in enumerate(probes) if not probe.serving]
        failure = failure_from_probes(clients, probes, bad, message)
        if not failure.pods and suspects:
            failure = PodFailure(str(failure), tuple(suspects), ())
        return failure

    def watchdog(self) -> Watchdog:
        """A watchdog over every live pod, started."""
        health = self.config.health
        return Watchdog(self.live_clients, health.interval_s, health.timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        """Wait until every pod serves again (WorkerError naming one that does not)."""
        parallel(lambda c: c.wait_serving(timeout_s), self.clients)

    def reattach(self) -> list[pb.ConfigureReply] | None:
        """A controller restarted mid-run: take the pods as they are if every one is configured
        with this run's config and all hold the same state at the same step (Configure with
        keep_state; their links restart under a new run id). None if they do not (the caller
        configures afresh and restores a checkpoint)."""
        self.dcn_addresses = self.collect_dcn_addresses()
        try:
            replies = self._configure(self.clients, keep_state=True)
        except Exception:   # e.g. a pod not configured (FAILED_PRECONDITION): not reattachable
            return None
        if any(len({get(r) for r in replies}) > 1 for _, get in AGREEMENT):
            return None
        self.first_replies, self.fresh_reference = list(replies), False
        return replies

    def unconfigured(self) -> list[int]:
        """The pods that are not configured (restarted since the last configure)."""
        timeout = self.config.health.timeout_s
        statuses = parallel(lambda c: c.status(timeout), self.clients)
        return [c.pod_index for c, s in zip(self.clients, statuses) if not s.configured]


def connect(addresses: list, config: Config, generation_only: bool = False) -> Cluster:
    """A Cluster of clients for every pod, each checked for readiness within the deadline
    (generation_only: the pods of `multipod generate`, see Cluster).
    addresses[p]: pod p's hosts, a list of HOST:PORT or one string with them separated by ","
    (addresses.py's parse_workers makes the lists from --workers). A pod of one host gets a WorkerClient,
    a pod of several a PodClient over its hosts."""
    pods = [pod_hosts(entry) for entry in addresses]
    counts = {len(hosts) for hosts in pods}
    if len(counts) > 1 or 0 in counts:
        detail = "; ".join(f"pod {p}: {len(hosts)} host(s)" for p, hosts in enumerate(pods))
        raise RunError(f"every pod must have the same number of hosts (at least one): {detail}")
    clients = [make_pod_client(i, hosts) for i, hosts in enumerate(pods)]
    try:
        parallel(lambda c: c.wait_ready(config.run.connect_timeout_s), clients)
    except Exception:
        for client in clients:
            client.close()
        raise
    return Cluster(clients, config, generation_only)
