"""Who a pod exchanges with, and how a pod gets back into a run: the DCN exchange it builds for
a run id, its peers and a membership (`_new_exchange`, `_start_timeline`); a new controller taking
the pod over (`reattach`); degraded mode (`set_membership`); the state transfer to a rejoining pod
(`send_state` from a live pod, `receive_state` on the rejoining one).

`PodMembership` is a mixin of `Pod` (pod.py) and owns no state: every attribute it uses is the
Pod's, set in `Pod.__init__` and declared below. The Pod's sequencer is the lock: the exchange,
the setup and the checksum change only while the sequencer has given the pod to one caller (a
`self.seq.hold(...)` here; a running step in pod.py), so no step runs on a half-changed pod. The
one call made without it is `Exchange.abort`, which is thread-safe and is what cuts short a step
still waiting on a dead peer before the hold is asked for.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from multipod.pod_worker.dcn import Exchange, Listener
from multipod.pod_worker.errors import CorruptTransfer, InvalidRequest, NotReady
from multipod.pod_worker.hosts import HostLayout
from multipod.pod_worker.schema import WorkerConfig, streams_per_peer, this_host_cpus
from multipod.pod_worker.sequencer import Sequencer
from multipod.pod_worker.trainer import PodTrainer, fingerprint
from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.pod_worker.pod import Setup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Membership:
    """The pod after SetMembership: where it stands, to compare with the other pods."""
    step: int
    checksum: str
    fingerprint: str
    config_hash: str
    aborted_step: bool


@dataclasses.dataclass(frozen=True)
class Transferred:
    step: int
    fingerprint: str
    bytes: int
    seconds: float


class PodMembership:
    """The Pod's membership, takeover and state-transfer operations (see the module's docstring).
    Uses the Pod's `setup()` and the attributes below, all owned by the Pod."""
    pod_index: int | None           # None: a spare without a slot yet
    layout: HostLayout              # this worker's host in a pod of several hosts
    listener: Listener | None       # the worker's data-plane socket
    seq: Sequencer                  # the lock: see the module's docstring
    exchange: Exchange | None       # swapped only inside a sequencer hold
    _setup: Setup | None            # replaced as a whole (dataclasses.replace), inside a hold
    _peers: list[str]               # every pod's data-plane address, in pod order (as configured)
    _checksum: tuple[int, str]      # (step, on-device checksum) of the state as of its last change

    # -- the exchange: with whom, under which run id -------------------------------------------
    def _host_address(self, address: str) -> str:
        """One pod's data-plane address for this host: with several hosts per pod an address may
        list every host's ("A|B|..."), and host h exchanges with host h of the other pods."""
        parts = address.split("|")
        if len(parts) == 1:
            return address
        if len(parts) != self.layout.hosts_per_pod:
            raise InvalidRequest(f"data-plane address {address!r} lists {len(parts)} hosts, the pod has "
                                 f"{self.layout.hosts_per_pod}")
        return parts[self.layout.host_index]

    def _new_exchange(self, run_id: str, trainer: PodTrainer, config: WorkerConfig, peers: list[str],
                      hosts: tuple[int, ...] | None = None) -> Exchange:
        """A DCN exchange under `run_id` with `peers` (every pod's data-plane address, in pod
        order) among `hosts` (None: every pod computes its own slot). Also built by configure
        and restore (pod.py)."""
        peers = [self._host_address(a) for a in peers]
        dcn = config.exchange_dcn()
        if dcn.streams == "auto":       # the count for this host and the step the pod now runs
            overlapped = trainer.overlapped and not config.sync.diloco
            dcn = dataclasses.replace(dcn, streams=streams_per_peer(dcn.streams, overlapped))
            log.info("pod %d: %d data-plane stream(s) per peer (dcn.streams = auto: %s step, %d CPUs)",
                     self.pod_index, dcn.streams, "overlapped" if overlapped else "fused", this_host_cpus())
        return Exchange(run_id, self.pod_index, peers, trainer.exchange_specs, self.listener, dcn=dcn,
                        hosts=list(hosts) if hosts is not None else None)

    def _start_timeline(self, run_id: str, hosts: tuple[int, ...] | None, why: str) -> Setup:
        """Inside a hold: a new exchange under `run_id` among `hosts` (built before the old one
        closes), and a new timeline at the pod's step (steps queued before are refused)."""
        setup = self.setup()
        trainer = setup.trainer
        exchange = self._new_exchange(run_id, trainer, setup.config, self._peers, hosts)
        if self.exchange is not None:
            self.exchange.close()
        self.exchange = exchange
        exchange.inbox.set_next_step(trainer.exchange_key)
        epoch = self.seq.reset(trainer.step, why)
        self._setup = dataclasses.replace(setup, epoch=epoch, hosts=hosts, run_id=run_id)
        return self._setup

    # -- a new controller takes the pod over ---------------------------------------------------
    def reattach(self, config: WorkerConfig, num_pods: int, peers: list[str], run_id: str,
                 deadline: float) -> tuple[PodTrainer, str]:
        """A new controller takes the pod over mid-run: keep the trainer and its state if it was
        configured with exactly `config` for `num_pods` at the same peers (NotReady otherwise);
        only the exchange restarts, under `run_id`, with every pod taking part. A step still
        waiting in the old exchange fails at once (its state stays as before it)."""
        setup = self.setup()
        if setup.config.config_hash() != config.config_hash() or setup.num_pods != num_pods or self._peers != peers:
            raise NotReady(f"pod {self.pod_index} runs another configuration: it cannot be reattached as it is")
        if self.exchange is not None:
            self.exchange.abort(f"pod {self.pod_index}: a new controller took the pod over")
        with self.seq.hold("a reattach", deadline):
            trainer = self._start_timeline(run_id, None, "taken over by a new controller").trainer
            fp = trainer.fingerprint()
        return trainer, fp

    # -- membership: degraded mode and rejoin --------------------------------------------------
    def set_membership(self, run_id: str, hosts: list[int] | None, deadline: float,
                       peers: list[str] | None = None) -> Membership:
        """From the next step on, exchange under `run_id` among the pods in `hosts` (hosts[slot]:
        the pod computing slot's shard; None: every pod its own). A step still waiting in the old
        exchange fails at once (its state stays as before it: the controller retries it); steps
        queued before this call are refused. InvalidRequest if the assignment does not fit.
        peers: every pod's data-plane address, in pod order, when a slot moved to a new worker
        (hot-swap); None keeps them."""
        setup = self.setup()
        num_pods = setup.num_pods
        if peers is not None:
            if len(peers) != num_pods:
                raise InvalidRequest(f"{len(peers)} data-plane addresses for {num_pods} pods")
            for address in peers:
                self._host_address(address)     # InvalidRequest if it does not fit this pod's hosts
        if hosts is not None:
            hosts = tuple(int(h) for h in hosts)
            if len(hosts) != num_pods or any(not 0 <= h < num_pods for h in hosts):
                raise InvalidRequest(f"hosts must give a pod in [0, {num_pods}) for each of the {num_pods} slots, "
                                     f"got {list(hosts)}")
            if any(hosts[h] != h for h in set(hosts)):
                raise InvalidRequest(f"hosts {list(hosts)}: a live pod must compute its own shard")
            if self.pod_index not in hosts:
                raise NotReady(f"pod {self.pod_index} is not among the hosts {list(hosts)}: it has to rejoin first")
            if hosts == tuple(range(num_pods)):
                hosts = None
        aborted = self.seq.state == pb.WORKER_STATE_STEPPING
        if self.exchange is not None:
            self.exchange.abort(f"pod {self.pod_index}: the controller changed the pods taking part")
        with self.seq.hold("a membership change", deadline):
            if peers is not None:
                self._peers = list(peers)
            setup = self._start_timeline(run_id, hosts, "given a new membership")
            trainer = setup.trainer
            if trainer.outer is not None:   # DiLoCo: replicas of the slots whose pods are back go
                hosted = set(setup.extra_slots(self.pod_index))
                trainer.outer.release([slot for slot in trainer.outer.replicas if slot not in hosted])
            self._checksum = (trainer.step, trainer.checksum())
            return Membership(trainer.step, self._checksum[1], trainer.fingerprint(), setup.config.config_hash(),
                              aborted)

    def send_state(self, transfer_id: str, to_pod: int, to_address: str, deadline: float) -> Transferred:
        """Stream this pod's parameters and optimizer state to a rejoining pod over the data plane
        (between steps: waits until `deadline` for a running one)."""
        import jax

        from multipod.pod_worker.dcn.transfer import send_state
        setup = self.setup()
        if not 0 <= to_pod < setup.num_pods or to_pod == self.pod_index:
            raise InvalidRequest(f"to_pod {to_pod} is not another pod of the run")
        with self.seq.hold("sending the state to a rejoining pod", deadline):
            trainer = self.setup().trainer
            # DiLoCo: the slot's own state, if this pod kept its replica ("replay"); else this pod's.
            state = trainer.host_state(replica=to_pod)
            fp = fingerprint(state["params"], state["opt_state"], state.get("outer", {}))
            leaves = [np.asarray(leaf) for leaf in jax.tree.leaves((state["params"], state["opt_state"],
                                                                    state.get("outer", {})))]
            dcn = setup.config.dcn
            stats = send_state(self.pod_index, transfer_id, to_pod, self._host_address(to_address), leaves,
                               trainer.step, fp,
                               self.listener.secret, deadline, chunk_bytes=dcn.chunk_bytes,
                               streams=streams_per_peer(dcn.streams))
        return Transferred(trainer.step, fp, stats.bytes, stats.seconds)

    def receive_state(self, transfer_id: str, from_pod: int, deadline: float) -> Transferred:
        """Take a live pod's parameters and optimizer state over the data plane. What arrives is
        staged; it replaces the state only when complete and its fingerprint is the donor's.
        Anything less (a cut stream, a wrong hash) leaves the state as it was."""
        import jax

        from multipod.pod_worker.dcn import LeafSpec
        from multipod.pod_worker.dcn.transfer import StateReceiver
        setup = self.setup()
        if not 0 <= from_pod < setup.num_pods or from_pod == self.pod_index:
            raise InvalidRequest(f"from_pod {from_pod} is not another pod of the run")
        start = time.perf_counter()
        with self.seq.hold("receiving a peer's state", deadline, state=pb.WORKER_STATE_RESTORING):
            setup = self.setup()
            trainer = setup.trainer
            # The state's layout (a pod that awaits its state holds none yet).
            current = (trainer.state_abstract["params"], trainer.state_abstract["opt_state"], trainer.outer_arrays())
            leaves, treedef = jax.tree.flatten(current)
            specs = [LeafSpec(tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves]
            receiver = StateReceiver(transfer_id, self.pod_index, from_pod, specs,
                                     chunk_bytes=setup.config.dcn.chunk_bytes)
            self.listener.attach(receiver)
            try:
                step, donor_fp, arrays, nbytes = receiver.wait(deadline)
            finally:
                if self.exchange is not None:
                    self.listener.attach(self.exchange.inbox)
            params, opt_state, outer = jax.tree.unflatten(treedef, arrays)
            fp = fingerprint(params, opt_state, outer)
            if fp != donor_fp:
                raise CorruptTransfer(f"the state from pod {from_pod} hashes to {fp}, the donor's is {donor_fp}: "
                                      f"not taken")
            trainer.load_state(params, opt_state, step)
            if trainer.outer is not None:       # DiLoCo: the outer state too (no sync pending: send_state)
                trainer.outer.load(outer, {"pending": None}, trainer.step)
            self._checksum = (trainer.step, trainer.checksum())
            if self.exchange is not None:
                self.exchange.inbox.set_next_step(trainer.exchange_key)
            epoch = self.seq.reset(trainer.step, "given a peer's state")
            self._setup = dataclasses.replace(setup, epoch=epoch)
        return Transferred(step, fp, nbytes, time.perf_counter() - start)
