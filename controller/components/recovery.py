"""Recovery: after a pod failure, bring every pod back to the last good checkpoint (with
recovery.on_pod_failure = "restore", within recovery.max_restarts); after a loss spike, rewind to
the checkpoint before it and skip spike.skip_batches batches."""
from __future__ import annotations

from typing import TYPE_CHECKING

from multipod.controller.cluster.client import WorkerError
from multipod.controller.cluster.pods import Cluster
from multipod.controller.components.checkpointer import Checkpointer
from multipod.controller.components.spike import Spike, SpikePolicy
from multipod.controller.core.errors import PodFailure, RunError
from multipod.controller.observe.events import EventKind, EventLog
from multipod.controller.observe.metrics import out

if TYPE_CHECKING:
    from multipod.controller.core.run_config import RecoveryConfig


class Recovery:
    """Counts recoveries and rewinds and performs them. config: the run's [recovery]; spike: the
    SpikePolicy (its config's skip_batches); supervisor: an object with kill(pod) that gets a hung
    pod restarted (LocalPods); without one, the user's supervisor must restart it."""

    def __init__(self, config: RecoveryConfig, cluster: Cluster, checkpointer: Checkpointer, spike: SpikePolicy,
                 events: EventLog, supervisor=None):
        self.config = config
        self.cluster, self.checkpointer, self.spike, self.events = cluster, checkpointer, spike, events
        self.supervisor = supervisor
        self.restarts = 0
        self.rewinds = 0
        # DiLoCo: rebuilds the failed slots' replicas after a restore in degraded mode
        # (components/replay.py); set by the run.
        self.replayer = None

    def restore_last_good(self) -> int:
        """Every live pod back to the last good checkpoint, once the saves under way are done, and
        the spike policy's history restarted there (a recovery; the failover's realignment of
        DiLoCo survivors at different steps); returns its step. RunError if there is none."""
        self.checkpointer.collect(block=True)
        if self.checkpointer.last_good is None:
            raise RunError("no checkpoint to go back to")
        step = self._restore()
        self.spike.restart_at(step)
        return step

    def _restore(self) -> int:
        """Every live pod back to the last good checkpoint; in a degraded DiLoCo "replay" run the
        failed slots adopted again from their parts of it (the restore cleared the replicas that
        their shards train on). Returns its step."""
        step = self.checkpointer.restore()
        if self.replayer is not None and self.cluster.degraded:
            config = self.cluster.config
            self.replayer.adopt_again(step, config.run.step_timeout_s + config.dcn.timeout_s)
        return step

    def recover(self, failure: PodFailure) -> int:
        """Wait for every pod to serve, configure the restarted ones (refusing any that differ
        from the pods that stayed up), restore the last good checkpoint; returns the step to
        continue from. RunError once recovery.max_restarts recoveries have been used."""
        config = self.config
        out(f"pod failure: {failure}")
        self.events.write(EventKind.POD_FAILURE, error=str(failure), pods=list(failure.pods))
        self.checkpointer.collect(block=False)
        last = self.checkpointer.describe_last_good()
        if self.restarts >= config.max_restarts:
            raise RunError(f"{failure}. Giving up after {self.restarts} restart(s) (--max-restarts "
                           f"{config.max_restarts}); the last good checkpoint is {last}: continue with --resume")
        self.restarts += 1
        if self.supervisor is not None:
            # A hung worker is killed so that the supervisor restarts it; a dead one is already
            # being restarted (killing it now could hit its new incarnation).
            for pod in failure.hung:
                self.supervisor.kill(pod)
        out(f"recovery {self.restarts}/{config.max_restarts}: waiting up to {config.restart_timeout_s:g}s "
            f"for every pod to serve, then restoring {last}")
        try:
            self.cluster.wait_serving(config.restart_timeout_s)
            fresh = self.cluster.unconfigured()
            if fresh:
                out(f"configuring restarted pod(s) {fresh}")
                self.cluster.configure_restarted(fresh)
            step = self.restore_last_good()
        except (WorkerError, RunError) as exc:
            raise RunError(f"recovery from ({failure}) failed: {exc}; the last good checkpoint is {last}") from None
        out(f"recovered: every pod restored to step {step}; continuing")
        self.events.write(EventKind.RECOVERED, step=step, restarts=self.restarts)
        return step

    def rewind(self, spike: Spike) -> int:
        """Restore the checkpoint from before the spike and skip the next spike.skip_batches
        batches; returns the step to continue from. RunError after max(1, recovery.max_restarts)
        rewinds."""
        skip = self.spike.config.skip_batches
        self.checkpointer.collect(block=True)
        last_good = self.checkpointer.last_good
        if self.rewinds >= max(1, self.config.max_restarts):
            raise RunError(f"{spike}; loss spikes persist after {self.rewinds} rewind(s)")
        if last_good is None or last_good.step > spike.step:
            raise RunError(f"{spike}; no checkpoint from before it to rewind to")
        self.rewinds += 1
        self.checkpointer.data_offset += skip
        step = self._restore()
        offset = self.checkpointer.data_offset
        out(f"loss spike at {spike}: rewound to step {step}, skipping {skip} batch(es) "
            f"(step {step} now trains on batch {step + offset})")
        self.events.write(EventKind.REWIND, spike_step=spike.step, loss=spike.loss, mean=spike.mean, to_step=step,
                          data_offset=offset)
        self.spike.restart_at(step)
        return step
