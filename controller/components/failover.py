"""Degraded mode (recovery.on_pod_failure = "degrade", the default): a failed pod's shard goes to the
survivors and the run goes on, bitwise as if nothing had happened; the pod rejoins from a live
peer when it serves again.

  failure   Failover.degrade: the failed pods leave `Cluster.hosts`, each of their slots goes to
            the live pod computing the fewest shards; every survivor gets the new membership
            (a step stuck waiting on a dead pod fails at once, its state untouched) and the run
            continues from the step every survivor has reached. A survivor left a step behind
            (its peers finished the step it failed) takes a peer's state first.
  rejoin    a watcher thread per failed pod waits until it serves, configures it if it was
            restarted, and marks it ready; at the next step boundary (on_step) the pipeline is
            drained, a live pod streams it the state over the data plane (verified by
            fingerprint), and it takes its own shard back.
  hot-swap  with a standby pod in the run's SparePool (cluster/spares.py), the watcher does not
            wait for the failed pod: the spare takes its slot at its own address (Cluster.swap_in)
            and is configured there; at the step boundary it gets the state like a rejoining pod,
            and every pod learns the slot's new data-plane address with the new membership.

No shared storage is involved; checkpoints remain for crashes of the whole run."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster
from multipod.controller.cluster.spares import SparePool
from multipod.controller.components.checkpointer import slot_source
from multipod.controller.core import fault_hooks
from multipod.controller.core.errors import Divergence, PodFailure, RunError
from multipod.controller.core.policies import OnPodFailure
from multipod.controller.observe.events import EventKind, EventLog
from multipod.controller.observe.metrics import out

if TYPE_CHECKING:
    from multipod.controller.core.run_config import RecoveryConfig

REJOIN_ATTEMPTS = 3         # state transfers tried per failed pod before it is left out for the run
REJOIN_POLL_S = 1.0         # how often a watcher checks a failed pod


def reassign(hosts: list[int], failed: set[int]) -> list[int]:
    """hosts[slot] after `failed` pods leave: each of their slots goes to the live pod computing
    the fewest shards (ties: the lowest index). RunError if no pod is left."""
    live = sorted(set(hosts) - failed)
    if not live:
        raise RunError(f"every pod has failed (pods {sorted(failed)}): nothing left to train on")
    new = list(hosts)
    load = {p: sum(1 for h in hosts if h == p) for p in live}
    for slot, host in enumerate(hosts):
        if host in failed:
            target = min(live, key=lambda p: (load[p], p))
            new[slot] = target
            load[target] += 1
    return new


def split_microbatches(hosts: list[int], microbatches: int) -> dict[int, list[int]]:
    """{failed slot: microbatch_hosts}: each failed slot's microbatches over the live pods, one
    contiguous run per pod, as even as the count allows (the larger runs last), the runs in
    live-pod order with the slot's host last (it ends the slot's sum; pod_worker/split.py). With
    fewer microbatches than live pods, the last ones in that order (the host included) take one
    each. Every live pod then computes its own shard and about 1/(live pods) of every failed
    slot's, instead of one survivor computing a whole failed shard. {} when no slot has failed."""
    live = sorted(set(hosts))
    splits = {}
    for slot, host in enumerate(hosts):
        if host == slot:
            continue
        chain = [p for p in live if p != host] + [host]
        chain = chain[max(0, len(chain) - microbatches):]
        bounds = [microbatches * j // len(chain) for j in range(len(chain) + 1)]
        splits[slot] = [pod for j, pod in enumerate(chain) for _ in range(bounds[j], bounds[j + 1])]
    return splits


class _Rejoin:
    """One failed pod on its way back: a thread that hands its slot to a spare if the pool has one
    (hot-swap), or else waits for it to serve, and configures it if it was restarted (that
    compiles: it runs while the survivors train). swapped: (old address, new address) once a
    spare took the slot."""

    def __init__(self, cluster: Cluster, pod: int, timeout_s: float, spares: SparePool | None = None,
                 attempts: int = 0, swapped: tuple[str, str] | None = None):
        self.cluster, self.pod, self.spares = cluster, pod, spares
        self.ready = threading.Event()
        self.error: str | None = None
        self.attempts = attempts
        # Given before the thread starts: a retry of a slot a spare took must not take another spare.
        self.swapped: tuple[str, str] | None = swapped
        self.since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), daemon=True, name=f"rejoin-{pod}")
        self._thread.start()

    def _hot_swap(self) -> bool:
        """Give the slot to the pool's next spare and configure it there; whether one took it (a
        spare that fails is named and left out; the next is tried at the next poll)."""
        spare = self.spares.take() if self.spares is not None else None
        if spare is None:
            return False
        try:
            old = self.cluster.swap_in(self.pod, spare)
        except (WorkerError, RunError) as exc:
            out(f"spare {spare.name} could not take slot {self.pod}: {exc}")
            return False
        # From here the slot is the spare's: a failed configure is retried on it like a restarted pod's.
        self.swapped = (old, spare.name)
        out(f"hot-swap: the spare at {spare.name} takes slot {self.pod} (was {old}): configuring it")
        self.cluster.configure_restarted([self.pod])
        return True

    def _run(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set():
            client = self.cluster.clients[self.pod]      # a spare's, once one took the slot
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.error = f"{client.name} did not serve again within {timeout_s:g}s"
                    return
                if self.swapped is None and self._hot_swap():
                    self.ready.set()
                    return
                if not client.probe(self.cluster.config.health.timeout_s).serving:
                    self._stop.wait(REJOIN_POLL_S)
                    continue
                if not client.status(self.cluster.config.health.timeout_s).configured:
                    out(f"{client.name} serves again: configuring it")
                    self.cluster.configure_restarted([self.pod])
                self.ready.set()
                return
            except (WorkerError, RunError) as exc:
                self.error = str(exc)
                self._stop.wait(REJOIN_POLL_S)
                if isinstance(exc, RunError):
                    return

    @property
    def gave_up(self) -> bool:
        """The watcher ended without the pod becoming ready (error says why)."""
        return not self.ready.is_set() and not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()


class Failover:
    """Counts pod failures (within recovery.max_restarts), runs degraded mode and rejoins (a
    failed pod is waited for recovery.restart_timeout_s). config: the run's [recovery];
    supervisor: an object with kill(pod) that gets a hung pod restarted (LocalPods), or None."""

    def __init__(self, config: RecoveryConfig, cluster: Cluster, events: EventLog, supervisor=None,
                 spares: SparePool | None = None):
        self.config = config
        self.cluster, self.events, self.supervisor, self.spares = cluster, events, supervisor, spares
        self.hot_swaps = 0
        self.outvoted = 0
        self.failures = 0
        self.rejoins = 0
        self.transfer_bytes = 0
        self.transfer_s = 0.0
        self.degraded_s = 0.0
        self._degraded_since: float | None = None
        self._rejoining: dict[int, _Rejoin] = {}
        # DiLoCo, sync.on_pod_failure = "replay": rebuilds a failed pod's state on its slot's host
        # (components/replay.py); set by the run.
        self.replayer = None
        # DiLoCo: () -> step, every live pod back to the last good checkpoint (failed slots adopted
        # again with "replay"), for survivors that stopped at different steps; set by the run.
        # None: such a run stops, to be resumed.
        self.restore_checkpoint = None
        self.realigned = 0

    @property
    def timeout_s(self) -> float:
        return self.cluster.config.run.step_timeout_s + self.cluster.config.dcn.timeout_s

    # -- a failure -------------------------------------------------------------------------------
    def degrade(self, failure: PodFailure) -> int:
        """Take the failed pods out, hand their shards to the survivors, and return the step to
        continue from (no step is lost or run twice). RunError once recovery.max_restarts failures
        have been handled, or if no pod is left."""
        cluster = self.cluster
        out(f"pod failure: {failure}")
        self.events.write(EventKind.POD_FAILURE, error=str(failure), pods=list(failure.pods), mode=OnPodFailure.DEGRADE)
        if self.failures >= self.config.max_restarts:
            raise RunError(f"{failure}. Giving up after {self.failures} pod failure(s) (--max-restarts "
                           f"{self.config.max_restarts})")
        self.failures += 1
        failed = set(failure.pods)
        if self.supervisor is not None:
            for pod in failure.hung:     # killed so that the supervisor restarts it
                self.supervisor.kill(pod)
        for _attempt in range(cluster.size):
            cluster.hosts = reassign(cluster.hosts, failed)
            live = cluster.live
            try:
                replies = cluster.set_membership(live, self.timeout_s)
                break
            except (WorkerError, RunError) as exc:
                # A survivor that cannot take the membership has failed too: leave it out as well.
                probes = cluster.probe_all()
                more = {p for p, probe in zip(live, probes) if not probe.serving}
                more |= set(cluster.restarted([p for p in live if p not in more]))
                if not more:
                    raise RunError(f"degraded mode after ({failure}) failed: {exc}") from None
                failed |= more
        else:
            raise RunError(f"degraded mode after ({failure}) failed: pods kept failing")
        step, restored = self._align(live, replies)
        if not restored and self.replayer is not None and cluster.config.sync.on_pod_failure == "replay":
            for slot in sorted(failed):
                self.replayer.replay(slot, step, self.timeout_s)
        if self._degraded_since is None:
            self._degraded_since = time.monotonic()
        for pod in sorted(set(range(cluster.size)) - set(live)):
            self._watch(pod)
        if cluster.config.sync.diloco and cluster.config.sync.on_pod_failure == "drop":
            shards = ", ".join(f"slot {s} dropped: the outer steps average over the live pods"
                               for s, h in enumerate(cluster.hosts) if s != h)
        else:
            shards = ", ".join(f"slot {s} -> pod {h}" for s, h in enumerate(cluster.hosts) if s != h)
        out(f"degraded: {len(live)}/{cluster.size} pods from step {step} ({shards})")
        self.events.write(EventKind.DEGRADED, step=step, live_pods=live, hosts=list(cluster.hosts),
                          failed=sorted(failed))
        return step

    def outvote(self, diverged: Divergence) -> int:
        """Pods whose state a strict majority outvotes (silent corruption): taken out like failed
        pods (their shards go to the survivors), to rejoin from a majority peer's state once
        they serve; returns the step to continue from. The pods' state vote (pod_worker/dcn)
        kept the step after it from being applied anywhere with their gradients."""
        pods = list(diverged.outvoted)
        out(f"silent corruption: after step {diverged.step} the state of pod(s) {pods} differs from the majority's "
            f"({diverged.majority}): they are taken out and rejoin from a majority peer")
        self.events.write(EventKind.OUTVOTED, step=diverged.step, pods=pods, majority=diverged.majority,
                          checksums={str(p): c for p, c in diverged.checksums.items()}, leaf=None)
        self.outvoted += len(pods)
        return self.degrade(PodFailure(str(diverged), pods))

    def _align(self, live: list[int], replies) -> tuple[int, bool]:
        """The step to continue from, and whether the live pods were restored to get there: the
        furthest any survivor got. Survivors there must hold the same state; one left behind (it
        failed a step its peers finished) takes a peer's state. DiLoCo survivors at different steps
        go back to the last good checkpoint together (restore_checkpoint)."""
        steps = {p: int(r.step) for p, r in zip(live, replies)}
        top = max(steps.values())
        if self.cluster.config.sync.diloco and len(set(steps.values())) > 1:
            # A DiLoCo pod's own state is its own: a peer's cannot stand in for it. Typically an
            # outer exchange reached some survivors and not others when the pod died mid-send.
            if self.restore_checkpoint is None:
                raise RunError(f"the surviving pods stopped at different steps ({steps}): a DiLoCo run cannot "
                               f"realign them; resume it from the last checkpoint (multipod ... --resume)")
            out(f"the surviving pods stopped at different steps ({steps}), DiLoCo states a peer cannot stand in "
                f"for: every live pod goes back to the last good checkpoint")
            try:
                step = self.restore_checkpoint()
            except (WorkerError, RunError) as exc:
                raise RunError(f"the surviving pods stopped at different steps ({steps}) and could not go back to "
                               f"the last checkpoint: {exc}; resume the run from it (multipod ... --resume)") from None
            self.realigned += 1
            self.events.write(EventKind.REALIGNED, step=step, steps={str(p): s for p, s in steps.items()})
            return step, True
        ahead = [p for p in live if steps[p] == top]
        prints = {replies[live.index(p)].fingerprint for p in ahead}
        if len(prints) > 1:
            raise RunError(f"the surviving pods diverged at step {top}: their state fingerprints differ")
        for pod in (p for p in live if steps[p] != top):
            self._transfer(ahead[0], pod, why=f"it was left at step {steps[pod]}")
        return top, False

    def _watch(self, pod: int) -> None:
        if pod not in self._rejoining:
            self._rejoining[pod] = _Rejoin(self.cluster, pod, self.config.restart_timeout_s, self.spares)

    def _transfer(self, donor: int, receiver: int, why: str) -> tuple[int, float]:
        """Stream donor's state to receiver (verified); (bytes, seconds)."""
        start = time.monotonic()
        sent, got = self.cluster.transfer_state(donor, receiver, self.timeout_s)
        seconds = time.monotonic() - start
        self.transfer_bytes += int(got.bytes)
        self.transfer_s += seconds
        rate = got.bytes / seconds / 1e6 if seconds > 0 else 0.0
        out(f"state transfer: pod {donor} -> pod {receiver} ({why}): {got.bytes / 2**20:.1f} MiB in "
            f"{seconds:.2f}s ({rate:.0f} MB/s), step {got.step}, verified")
        self.events.write(EventKind.STATE_TRANSFER, donor=donor, receiver=receiver, step=int(got.step),
                          bytes=int(got.bytes), seconds=seconds, worker_seconds=float(got.seconds),
                          fingerprint=got.fingerprint)
        return int(got.bytes), seconds

    # -- the step boundary: rejoins ---------------------------------------------------------------
    def on_step(self, step: int, drain) -> bool:
        """At a step boundary: bring back every failed pod that is ready (drain the steps in
        flight, transfer a live pod's state, give every pod the new membership). Returns whether
        the membership changed (the next steps go to the new hosts)."""
        hold = fault_hooks.rejoin_by_step()
        if hold is not None and step >= hold:
            self._await_watchers()
        ready = [p for p, r in self._rejoining.items() if r.ready.is_set()]
        for pod, watcher in list(self._rejoining.items()):
            if watcher.gave_up:
                out(f"pod {pod} stays out: {watcher.error or 'it did not come back'}")
                self.events.write(EventKind.REJOIN_FAILED, pod=pod, error=watcher.error or "it did not come back")
                del self._rejoining[pod]
        if not ready:
            return False
        if self.cluster.config.sync.pending_after(step):
            return False    # DiLoCo: a pod rejoins at an outer boundary, with no sync under way
        drain()
        cluster = self.cluster
        joined = []
        swaps = []
        for pod in ready:
            watcher = self._rejoining[pod]
            try:
                # DiLoCo "replay": the slot's own state is its replica, on the slot's host. The same
                # pod wrote the slot's part of the checkpoints taken while it was out.
                donor = slot_source(cluster, pod)
                sent, seconds = self._transfer(donor, pod, why="hot-swapped" if watcher.swapped else "rejoining")
                joined.append(pod)
                del self._rejoining[pod]
                if watcher.swapped is not None:
                    swaps.append((pod, watcher, sent, seconds))
            except (WorkerError, RunError) as exc:
                watcher.attempts += 1
                out(f"pod {pod} could not rejoin (attempt {watcher.attempts}/{REJOIN_ATTEMPTS}): {exc}")
                self.events.write(EventKind.REJOIN_FAILED, pod=pod, error=str(exc), attempt=watcher.attempts)
                if watcher.attempts >= REJOIN_ATTEMPTS:
                    del self._rejoining[pod]
                else:   # its state is untouched: try again, from serving and configured
                    self._rejoining[pod] = _Rejoin(cluster, pod, self.config.restart_timeout_s, self.spares,
                                                   attempts=watcher.attempts, swapped=watcher.swapped)
        if not joined:
            return False
        hosts = list(cluster.hosts)
        for pod in joined:
            hosts[pod] = pod
        cluster.hosts = hosts
        replies = cluster.set_membership(cluster.live, self.timeout_s)
        if len({(r.step, r.fingerprint) for r in replies}) > 1:
            raise RunError(f"after pod(s) {joined} rejoined at step {step}, the pods' states differ")
        if not cluster.degraded and self._degraded_since is not None:
            self.degraded_s += time.monotonic() - self._degraded_since
            self._degraded_since = None
        self.rejoins += len(joined)
        out(f"pod(s) {joined} rejoined at step {step}: {len(cluster.live)}/{cluster.size} pods")
        self.events.write(EventKind.REJOIN, step=step, pods=joined, live_pods=cluster.live, hosts=list(cluster.hosts))
        for pod, watcher, sent, seconds in swaps:
            old, new = watcher.swapped
            since = time.monotonic() - watcher.since
            self.hot_swaps += 1
            if self.supervisor is not None and hasattr(self.supervisor, "swapped"):
                self.supervisor.swapped(pod, new)     # LocalPods: the slot's processes are the spare's now
            out(f"hot-swap: slot {pod} trains again at {new} (was {old}) from step {step}, "
                f"{since:.1f}s after it failed")
            self.events.write(EventKind.HOT_SWAP, step=step, slot=pod, old_address=old, new_address=new,
                              bytes=sent, seconds=seconds, since_failure_s=since)
        return True

    def note_outer(self, record) -> None:
        """A step's record (a StepRecord): a DiLoCo outer step that averaged over fewer than all
        the pods (sync.on_pod_failure = "drop") is an event naming the pods it averaged."""
        pods = record.outer_pods
        if not pods or len(pods) >= self.cluster.size:
            return
        dropped = sorted(set(range(self.cluster.size)) - set(pods))
        out(f"outer step {record.outer_sync} (fragment {record.outer_fragment}) after step {record.step}: averaged "
            f"over pods {list(pods)}, pod(s) {dropped} dropped")
        self.events.write(EventKind.OUTER_DROPPED, step=record.step, sync=record.outer_sync,
                          fragment=record.outer_fragment, pods=list(pods), dropped=dropped)

    def _await_watchers(self) -> None:
        """Wait until every failed pod on its way back is ready or its watcher has given up (the
        test hook MULTIPOD_TEST_REJOIN_BY_STEP); each watcher has its own deadline."""
        for watcher in list(self._rejoining.values()):
            while not watcher.ready.wait(REJOIN_POLL_S) and not watcher.gave_up:
                pass

    def close(self) -> None:
        """Stop the watchers; the time spent degraded until now is counted."""
        for watcher in self._rejoining.values():
            watcher.stop()
        if self._degraded_since is not None:
            self.degraded_s += time.monotonic() - self._degraded_since
            self._degraded_since = None
