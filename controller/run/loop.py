"""The step loop: it only runs steps. Step RPCs are pipelined `run.dispatch_depth` deep (the
shards of step s+1 travel while step s computes, so the controller stays off the critical path);
each finished step is checked (every pod's state checksum and skip decision must agree), recorded,
and shown to the components' hooks: the checkpointer and the failover (rejoins) at every step
boundary, the spike policy after every step. Each step goes to the live pods: in degraded mode
a pod also gets the shards of the failed pods it hosts (Cluster.hosts), or with microbatches
its run of every failed pod's shard (split by microbatch over the live pods). The cluster is an
argument, so tests drive the loop with fake pods."""
from __future__ import annotations

import collections
import time

import grpc

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster, Watchdog
from multipod.controller.components.failover import split_microbatches
from multipod.controller.components.spike import Spike, SpikePolicy
from multipod.controller.core.errors import Divergence, RunError
from multipod.controller.core.fault_hooks import StepHold
from multipod.controller.core.interrupt import raise_if_requested
from multipod.controller.data.batches import Prefetcher, StepData, token_dtype
from multipod.controller.observe.metrics import Accounting, Recorder, step_record
from multipod.controller.observe.records import StepRecord
from multipod.protos import multipod_pb2 as pb

POLL_S = 0.2          # how often a wait for a step checks the watchdog and the progress deadline
DATA_TIMEOUT_S = 60.0  # the data pipeline must deliver a step's shards within this


def _results(calls: list[tuple]) -> list | None:
    """The replies of [(client, call)], or None unless every call finished with one."""
    results = []
    for _, call in calls:
        if not call.done():
            return None
        try:
            results.append(call.result())
        except WorkerError:
            return None
    return results


def check_agreement(step: int, clients, replies) -> None:
    """Divergence (naming the pods, and those a majority outvotes) if the pods' state checksums
    differ, RunError if their fingerprints (when the step took them) or skip decisions do: the
    pods must stay bitwise identical."""
    sums = [r.checksum for r in replies]
    if len(set(sums)) > 1:
        raise Divergence(step, {c.pod_index: s for c, s in zip(clients, sums)})
    full = [r.fingerprint for r in replies]
    if any(full) and len(set(full)) > 1:
        detail = ", ".join(f"{c.name}: {p or 'missing'}" for c, p in zip(clients, full))
        raise RunError(f"step {step}: pods diverged, their state fingerprints differ ({detail})")
    if len({r.skipped for r in replies}) > 1:
        detail = ", ".join(f"{c.name}: {'skipped' if r.skipped else 'applied'}" for c, r in zip(clients, replies))
        raise RunError(f"step {step}: pods disagree on skipping the update ({detail})")


class StepLoop:
    """Runs the steps of one segment (from a start step to run.steps) on `cluster`.

    checkpointer: anything with on_step(step, drain), called at every step boundary and at the
    end; evaluator: None or the same (evaluation.Evaluator); failover: None or anything with note_outer(record) and
    on_step(step, drain) -> whether the live pods changed; spike: a SpikePolicy; recorder: where
    finished steps' records go; batches: a dataset.TokenDataset (batch(index), epoch(index))."""

    def __init__(self, cluster: Cluster, batches, checkpointer, spike: SpikePolicy, recorder: Recorder,
                 accounting: Accounting, failover=None, evaluator=None):
        self.cluster, self.batches, self.checkpointer, self.failover = cluster, batches, checkpointer, failover
        self.evaluator = evaluator
        self.spike, self.recorder, self.accounting = spike, recorder, accounting
        self.run_config = cluster.config.run
        # (step, (clients, hosts), calls) in flight, oldest first
        self._pending: collections.deque = collections.deque()
        self._watchdog: Watchdog | None = None
        self._last_done = 0.0        # perf_counter when the previous step finished (step time)
        self._last_progress = 0.0    # monotonic time of the last finished step (progress deadline)
        self._data_offset = 0
        self._restarts = 0
        # [(step, clients, hosts, replies)] of the steps some pods finished when another failed
        self._partials: list[tuple] = []
        # (step, survivors, hosts, calls): a step waited for when a pod went silent, whose
        # survivors had not all answered yet; their calls are left running, to be read next run()
        self._unanswered: tuple | None = None
        self._hold = StepHold()     # test hook (controller/core/fault_hooks.py); holds nothing in a run

    def run(self, start: int, data_offset: int = 0, restarts: int = 0) -> None:
        """Steps start..run.steps-1, step s training on batch s + data_offset, then the final
        step boundary. Raises PodFailure (a pod failed, died or hung), Spike (after the steps in
        flight have finished), or RunError (the pods diverged)."""
        stop = self.run_config.steps
        self._data_offset, self._restarts = data_offset, restarts
        prefetch = Prefetcher(self.batches, self.cluster.size, start, stop, offset=data_offset,
                              dtype=token_dtype(self.cluster.config.model.vocab_size))
        self._watchdog = self.cluster.watchdog()
        self._last_done, self._last_progress = time.perf_counter(), time.monotonic()
        self._read_unanswered()
        if [p[0] for p in self._partials] == list(range(start - len(self._partials), start)):
            for partial in self._partials:      # the survivors carry on from the step after them
                self._record_partial(*partial)
        self._partials = []
        try:
            try:
                for step in range(start, stop):
                    raise_if_requested()
                    if self._hold.at(step, self.drain):
                        self._last_done, self._last_progress = time.perf_counter(), time.monotonic()
                    self._boundary(step)
                    if self.failover is not None and self.failover.on_step(step, self.drain):
                        self._watchdog.stop()          # a pod rejoined: watch it too
                        self._watchdog = self.cluster.watchdog()
                    got, shards = prefetch.next(DATA_TIMEOUT_S)
                    if got != step:
                        raise RunError(f"the data pipeline delivered step {got} for step {step}")
                    self._dispatch(step, shards)
                    while len(self._pending) >= self.run_config.dispatch_depth or \
                            (self._pending and step == stop - 1):
                        self._complete_oldest()
                self._boundary(stop)
            except Spike:
                # The pods are healthy: let the steps in flight finish before the rewind restores
                # every pod (their results belong to the abandoned timeline).
                for _, _, calls in self._pending:
                    for call in calls:
                        call.wait(self.run_config.step_timeout_s)
                raise
        finally:
            kept = set(map(id, self._unanswered[3])) if self._unanswered is not None else set()
            for _, _, calls in self._pending:
                for call in calls:
                    if id(call) not in kept:
                        call.cancel()
            self._pending.clear()
            prefetch.close()
            self._watchdog.stop()

    def _boundary(self, step: int) -> None:
        """The components whose work needs every step before `step` done and none in flight."""
        self.checkpointer.on_step(step, self.drain)
        if self.evaluator is not None:
            self.evaluator.data_offset = self._data_offset
            if self.evaluator.on_step(step, self.drain):
                # It evaluated: that time is neither the next step's time nor a stall.
                self._last_done, self._last_progress = time.perf_counter(), time.monotonic()

    def drain(self) -> None:
        """Finish every step in flight (before a checkpoint: it must hold exactly that state)."""
        while self._pending:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        # Popped only once complete: a step that fails while being waited for is still in flight,
        # so the cleanup cancels its calls.
        self._complete(*self._pending[0])
        self._pending.popleft()

    def _dispatch(self, step: int, shards: StepData) -> None:
        """Send step `step` to every live pod: its own shard, and the shards of the failed pods
        it hosts (each in its slot)."""
        timeout = self.run_config.step_timeout_s
        every = self.run_config.fingerprint_every
        full = bool(every) and (step + 1) % every == 0    # the state after a multiple of N steps
        hosts = list(self.cluster.hosts)
        clients = self.cluster.live_clients
        splits = self._splits(hosts)
        calls = []
        # DiLoCo (sync.mode) with "drop": a failed pod's shards are not computed by anyone.
        sync = self.cluster.config.sync
        dropped = sync.diloco and sync.on_pod_failure == "drop"
        for client in clients:
            pod = client.pod_index
            extra = [] if dropped else [pb.Shard(slot=slot, tokens=shards.tokens[slot], loss_mask=shards.masks[slot],
                              microbatch_hosts=splits.get(slot, []))
                     for slot, host in enumerate(hosts)
                     if slot != pod and (pod in splits[slot] if slot in splits else host == pod)]
            request = pb.StepRequest(step=step, tokens=shards.tokens[pod], loss_mask=shards.masks[pod],
                                     global_tokens=shards.global_tokens, take_fingerprint=full, extra_shards=extra,
                                     run_id=self.cluster.run_id)
            calls.append(client.step_async(request, timeout))
        self._pending.append((step, (clients, hosts), calls))

    def _splits(self, hosts: list[int]) -> dict[int, list[int]]:
        """{failed slot: microbatch_hosts} of the shards split over the live pods (failover.split_microbatches),
        on pods of one host or several alike (host h relays its block of a partial sum to host h);
        the slot's host computes the shard whole when it has one microbatch, and DiLoCo splits nothing."""
        if hosts == list(range(len(hosts))) or self.cluster.config.sync.diloco:
            return {}
        splits = split_microbatches(hosts, self.cluster.config.model.microbatches)
        return {slot: run for slot, run in splits.items() if len(set(run)) > 1}

    def _finished_by(self, survivors: list) -> list[tuple]:
        """DiLoCo: the steps in flight after a failed one, as far as every survivor finishes them
        (an inner step needs no peer, so the survivors may be ahead of the failed pod by the
        steps in flight); each as a partial step (step, clients, hosts, replies)."""
        finished = []
        alive = {c.pod_index for c in survivors}
        for step, (clients, hosts), calls in list(self._pending)[1:]:
            replies = []
            for client, call in zip(clients, calls):
                if client.pod_index not in alive:
                    continue
                try:
                    if call.wait(self.run_config.step_timeout_s):
                        replies.append(call.result())
                except WorkerError:
                    pass
            if len(replies) != len(alive):
                break
            finished.append((step, [c for c in clients if c.pod_index in alive], hosts, replies))
        return finished

    def _keep_partial(self, step: int, clients, hosts, results) -> None:
        """Keep `step` as finished by the pods whose `results` came back (and, in DiLoCo, the
        steps in flight after it that they finish too), for run() to record if the survivors
        carry on from the step after it."""
        survivors = [c for c in clients if c.pod_index in {r.pod_index for r in results}]
        self._partials = [(step, survivors, hosts, results)]
        if self.cluster.config.sync.diloco:
            self._partials += self._finished_by(survivors)

    def _keep_finished(self, step: int, who: tuple, calls: list, failed: set[int]) -> None:
        """A pod named in `failed` went silent (watchdog, progress deadline) while `step` was
        waited for: the pods it does not name may have finished the step all the same (the silent
        pod sent its gradient, then hung before its reply left). Their replies, if all in, are
        kept like a failed step's survivors'. If some have not come yet, their calls are left
        running (not cancelled): the membership change that follows ends a step still waiting
        on the silent pod, so by the next run() each has finished or failed (_read_unanswered)."""
        clients, hosts = who
        survivors = [(c, call) for c, call in zip(clients, calls) if c.pod_index not in failed]
        if not survivors:
            return
        if all(call.done() for _, call in survivors):
            results = _results(survivors)
            if results is not None:
                self._keep_partial(step, clients, hosts, results)
            return
        self._unanswered = (step, [c for c, _ in survivors], hosts, [call for _, call in survivors])

    def _read_unanswered(self) -> None:
        """The replies of the survivors' calls _keep_finished left running: if every one finished
        the step (within the health check's deadline, shared), it is kept as a partial step."""
        if self._unanswered is None:
            return
        step, survivors, hosts, calls = self._unanswered
        self._unanswered = None
        deadline = time.monotonic() + self.cluster.config.health.timeout_s
        for call in calls:
            call.wait(max(0.0, deadline - time.monotonic()))
        results = _results(list(zip(survivors, calls)))
        for call in calls:
            call.cancel()
        if results is not None:
            self._keep_partial(step, survivors, hosts, results)

    def _record_partial(self, step: int, clients, hosts, replies) -> None:
        """The record of a step the survivors finished while a failed pod did not: its loss
        counts the shards whose results came back (partial_loss), its state is checked as any."""
        check_agreement(step, clients, replies)
        self.recorder.write(self._record(step, replies, 0.0, hosts, partial_loss=True))

    def _record(self, step: int, replies, step_time_s: float, hosts, partial_loss: bool = False) -> StepRecord:
        """The step's record, with where it stands in the run: the batch it trained on, the epochs
        done after it, the steps skipped so far and the restarts before it."""
        index = step + self._data_offset
        return step_record(step, replies, step_time_s, self.accounting, hosts=hosts, data_index=index,
                           epoch=self.batches.epoch(index),
                           skipped_steps=self.recorder.note_skipped(step, replies[0].skipped),
                           restarts=self._restarts, partial_loss=partial_loss,
                           hot_swaps=self.failover.hot_swaps if self.failover is not None else 0)

    def _complete(self, step: int, who: tuple, calls: list) -> None:
        """Wait for one step's replies (watching the pods meanwhile), check and record it."""
        clients, hosts = who
        progress_timeout = self.cluster.config.health.progress_timeout_s or self.run_config.step_timeout_s
        results, errors = [], []
        for client, call in zip(clients, calls):
            while not call.wait(POLL_S):
                raise_if_requested()
                failure = self._watchdog.failure
                if failure is None and time.monotonic() - self._last_progress > progress_timeout:
                    failure = self.cluster.diagnose(f"step {step}: no step finished for {progress_timeout:g}s")
                if failure is not None:
                    self._keep_finished(step, who, calls, set(failure.pods))
                    raise failure
            try:
                results.append(call.result())
            except WorkerError as exc:
                errors.append((client.pod_index, exc))
        if errors:
            if results:
                # Some pods finished the step before one failed (it died after sending its
                # gradient): if the survivors carry on from the step after it, it is recorded from
                # their replies (run() does that), never run again.
                self._keep_partial(step, clients, hosts, results)
            # The root cause first: a pod that failed outright, not its peers aborting or
            # losing their link to it (or cancelled by it).
            knock_on = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            errors.sort(key=lambda e: e[1].code in knock_on)
            suspects = [pod for pod, e in errors if e.code not in knock_on]
            raise self.cluster.diagnose(f"step {step} failed: " + "; ".join(str(e) for _, e in errors), suspects)
        try:
            check_agreement(step, clients, results)
        except Divergence as diverged:
            if diverged.outvoted:
                # The majority's state is the run's: the step counts (its record shows every pod's
                # checksum); the outvoted pods are taken out and brought back from a majority peer.
                self.recorder.write(self._record(step, results, time.perf_counter() - self._last_done, hosts))
            raise
        now = time.perf_counter()
        record = self.spike.with_test_spike(self._record(step, results, now - self._last_done, hosts))
        self._last_done, self._last_progress = now, time.monotonic()
        spike = self.spike.check(record)
        self.recorder.write(record)     # a spike's record is kept too: it shows what was rewound
        if self.failover is not None:
            self.failover.note_outer(record)
        if spike is not None:
            raise spike
