"""A training run from start to summary: connect and configure the pods, resume or take a
baseline, then run the step loop, handing pod failures and loss spikes to recovery, until
run.steps steps are done; then evaluate, sample and summarise.

The pieces each own one job: cluster.py (the pods), loop.py (the steps), checkpointer.py,
spike.py, recovery.py, metrics.py, events.py, summary.py."""
from __future__ import annotations

import json
import os
import pathlib

from multipod.controller.cluster.compile_marks import CompileMarks
from multipod.controller.cluster.pods import Cluster, connect
from multipod.controller.cluster.spares import Spare, SparePool
from multipod.controller.components.checkpointer import Checkpointer
from multipod.controller.components.evaluation import Evaluator
from multipod.controller.components.failover import Failover
from multipod.controller.components.recovery import Recovery
from multipod.controller.components.replay import Replayer, history_warning
from multipod.controller.components.spike import Spike, SpikePolicy
from multipod.controller.core.errors import Divergence, PodFailure, RunError
from multipod.controller.core.policies import OnPodFailure
from multipod.controller.core.run_config import Config, ConfigError
from multipod.controller.data.corpus import RunData, prepare, write_beside_checkpoints
from multipod.controller.observe.events import EventKind, EventLog
from multipod.controller.observe.metrics import Accounting, MetricsLog, ProgressLine, Recorder, out
from multipod.controller.observe.peak import resolve_peak
from multipod.controller.observe.records import StepRecord
from multipod.controller.run.loop import StepLoop
from multipod.controller.run.summary import Summary, finish, print_summary
from multipod.pod_worker.schema import Overlap, resolve_overlap

__all__ = ["PodFailure", "RunError", "Summary", "checkpoint_dir", "print_summary", "run_training", "train"]


def checkpoint_dir(config: Config, run_dir: pathlib.Path) -> str:
    """Where the run's checkpoints go (absolute: the workers may run in another directory)."""
    return str(pathlib.Path(config.checkpoint.dir or run_dir / "checkpoints").absolute())


def check_batch_splits(config: Config, num_pods: int) -> None:
    """ConfigError unless the global batch splits evenly over `num_pods` pods."""
    if config.data.global_batch % num_pods:
        raise ConfigError("data.global_batch", f"{config.data.global_batch} does not split over {num_pods} pods")


def run_training(config: Config, addresses: list[str], run_dir: pathlib.Path,
                 progress: ProgressLine | None = None, resume: bool = False, supervisor=None,
                 data: RunData | None = None, local: bool = False, spares: list[list[str]] | None = None) -> Summary:
    """Train for config.run.steps steps on the pods at `addresses`; returns the run summary.

    resume: continue from the newest checkpoint in the checkpoint directory. supervisor: an
    object with kill(pod) that gets a hung pod restarted (LocalPods); without one, the controller
    waits for the user's supervisor to bring a failed worker back. data: the run's prepared data
    (corpus.prepare; made here if not given), whose config (vocab resolved) replaces `config`.
    local: the pods run on this machine (its peak FLOP/s may be measured for MFU). spares: standby
    pods (each a list of its hosts' HOST:PORT) that take failed pods' slots (hot-swap); more can be
    offered while the run goes on (`multipod attach`, cluster/spares.py)."""
    if not addresses:
        raise ConfigError("--workers", "no worker addresses given")
    check_batch_splits(config, len(addresses))
    run_dir.mkdir(parents=True, exist_ok=True)
    # The tokenizer, the token cache and the vocabulary before the pods configure; config.json
    # holds the resolved config.
    data = data or prepare(config)
    config = data.config
    cluster = connect(addresses, config)
    try:
        return train(cluster, run_dir, data, progress, resume, supervisor, local, spares or [])
    finally:
        cluster.close()


def record_config(data: RunData, run_dir: pathlib.Path) -> None:
    """The run's resolved config in RUN_DIR/config.json, and it and the tokenizer beside the
    checkpoints (what `multipod generate` and `ptune` read them with)."""
    config = data.config
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    write_beside_checkpoints(data, checkpoint_dir(config, run_dir))


def _configuring(pods: int, local: bool, at_once: bool) -> str:
    """What the configure is about to do, said before it starts (it can take a while)."""
    if not local or pods == 1:
        return f"configuring {pods} pod(s): compiling the step (this takes a while the first time)"
    if at_once:
        return (f"configuring {pods} pod(s) at once: this machine's compilation cache holds their programs from an "
                f"earlier run")
    return (f"configuring {pods} pod(s): pod 0 compiles the step (this takes a while the first time), then the "
            f"others load it from the shared compilation cache")


def _accounting(cluster: Cluster, replies, local: bool) -> Accounting:
    """Configure's replies, reported to the user, as the accounting of every step's record."""
    config, first = cluster.config, replies[0]
    num_devices = sum(r.num_devices for r in replies)
    accounting = Accounting(model_flops_per_token=config.model.flops_per_token(config.data.seq_len),
                            peak_flops=resolve_peak(config.run, first.device_kind, num_devices, local),
                            num_devices=num_devices,
                            hardware_flops_per_step=sum(r.hardware_flops_per_step for r in replies))
    if first.memory_peak_bytes:
        out(f"compiled step: {first.memory_peak_bytes / 2**20:.1f} MiB per device (temporaries "
            f"{first.memory_temp_bytes / 2**20:.1f} MiB); "
            f"{accounting.hardware_flops_per_step / 1e9:.2f} hardware GFLOP per step")
    peak = accounting.peak_flops
    out(f"{cluster.size} pod(s) x {first.num_devices} {first.device_kind} device(s), mesh data={first.mesh_shape[0]} "
        f"model={first.mesh_shape[1]}; {first.param_count:,} parameters; "
        f"{accounting.model_flops_per_token / 1e6:.1f} MFLOP/token; peak "
        + (f"{peak / 1e9:.1f} GFLOP/s per device" if peak else
           "unknown (MFU not reported; pass --peak-flops, or run `multipod peak-flops` on a worker's machine)"))
    return accounting


def _reattach(cluster: Cluster, run_dir: pathlib.Path):
    """--resume after the controller itself died: the live workers' replies if every one still
    holds the same state at the same step (no checkpoint is read), else None. The data position
    continues from the last step recorded in metrics.jsonl."""
    replies = cluster.reattach()
    if replies is None:
        return None, 0
    offset = 0
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        # The last step record (evaluation records sit between them and have no "loss").
        last = next((r for r in map(json.loads, reversed(lines)) if "loss" in r), None)
        if last is not None:
            record = StepRecord.from_json(last)
            offset = record.data_index - record.step
    except (OSError, ValueError):
        pass
    return replies, offset


def _spare_pool(cluster: Cluster, run_dir: pathlib.Path, events: EventLog, spares) -> SparePool:
    """The run's standby pods: `spares` and any already in RUN_DIR/spares, checked now, and those
    offered there later; each compiles the run's programs on standby while the run goes on."""
    def refused(spare: Spare, why: str) -> None:
        out(f"spare refused: {why}")
        events.write(EventKind.SPARE_REFUSED, spare=spare.name, error=why)

    def ready(spare: Spare) -> None:
        out(f"spare ready: {spare.name} (compiled on standby; takes the slot of a pod that fails)")
        events.write(EventKind.SPARE_READY, spare=spare.name)

    return SparePool(cluster.check_spare, refused, ready, prepare=cluster.prepare_spare, run_dir=run_dir,
                     offers=spares)


def train(cluster: Cluster, run_dir: pathlib.Path, data: RunData, progress: ProgressLine | None = None,
          resume: bool = False, supervisor=None, local: bool = False,
          spares: list[list[str]] | None = None) -> Summary:
    """Configure `cluster`, then train to run.steps on `data`, evaluating every eval.every
    steps, recovering from pod failures (degraded mode or a checkpoint restore,
    recovery.on_pod_failure) and rewinding loss spikes; returns the run summary. With resume,
    reattach to workers that still hold a consistent state, else restore the newest checkpoint."""
    config, run = cluster.config, cluster.config.run
    degrade = config.recovery.on_pod_failure == OnPodFailure.DEGRADE
    if spares and not degrade:
        raise ConfigError("--spares", "a spare takes a failed pod's slot in degraded mode: it needs "
                          "recovery.on_pod_failure = \"degrade\" (the default)")
    if not resume:
        record_config(data, run_dir)
    # A resume records its config only once the pods took the checkpoint (below): a refused one
    # (another schedule, say) must not leave a config beside the checkpoints that they do not fit.
    reattached, offset = _reattach(cluster, run_dir) if resume else (None, 0)
    if reattached is not None:
        replies = reattached
        out(f"reattached to {cluster.size} live pod(s) at step {replies[0].step} (every state hash equal): "
            f"no checkpoint read")
    else:
        # A resumed run's pods take their state from the checkpoint: they build no initial state.
        replies = cluster.configure(shared_cache=CompileMarks.of_workers(os.environ) if local else None,
                                    announce=lambda at_once: out(_configuring(cluster.size, local, at_once)),
                                    awaits_state=resume)
    accounting = _accounting(cluster, replies, local)
    overlapped, why_not = resolve_overlap(config.worker_config(), config.data.global_batch // cluster.size)
    if not overlapped and config.dcn.overlap is Overlap.AUTO:
        out(f"dcn.overlap = auto: the pods run the fused step ({why_not})")
    base_fingerprint = replies[0].base_fingerprint or None      # prompt tuning: the same on every pod (cluster.py)
    if base_fingerprint:
        out(f"tuning a {config.prompt.kind} of {config.prompt.virtual_tokens} virtual tokens on the frozen base "
            f"{config.prompt.base_checkpoint} (fingerprint {base_fingerprint} on every pod)")
    events = EventLog(run_dir / "events.jsonl")
    checkpointer = Checkpointer(config.checkpoint, cluster, checkpoint_dir(config, run_dir), events)
    spike = SpikePolicy(config.spike)
    recovery = Recovery(config.recovery, cluster, checkpointer, spike, events, supervisor)
    pool = _spare_pool(cluster, run_dir, events, spares or []) if degrade else None
    failover = Failover(config.recovery, cluster, events, supervisor, pool)
    if config.sync.diloco:
        failover.replayer = recovery.replayer = Replayer(cluster, checkpointer, data.dataset, events)
        warning = history_warning(config, int(replies[0].param_count))
        if warning:
            out(f"WARNING: {warning}")
        failover.restore_checkpoint = recovery.restore_last_good
    try:
        if reattached is not None:
            start = int(replies[0].step)
            checkpointer.data_offset = offset
            events.write(EventKind.REATTACHED, step=start, data_offset=offset, fingerprint=replies[0].fingerprint)
            if start > run.steps:
                raise ConfigError("run.steps", f"{run.steps} is behind the pods' step {start}; "
                                  f"resume with --steps {start} or more")
        elif resume:
            start = checkpointer.resume()
            if checkpointer.last_good is not None:     # None: a DiLoCo warm start, which said so
                out(f"resumed from {checkpointer.last_good.path} (step {start}, "
                    f"data position {start + checkpointer.data_offset})")
            if start > run.steps:
                raise ConfigError("run.steps", f"{run.steps} is behind the checkpoint's step {start}; "
                                  f"resume with --steps {start} or more")
        else:
            start = int(replies[0].step)   # the checkpointer takes a baseline at this first boundary
        if resume:
            record_config(data, run_dir)
        recorder = Recorder(MetricsLog(run_dir, append=resume), progress or ProgressLine(run.steps, start))
        evaluator = Evaluator(config.eval, cluster, data.dataset, recorder.write_eval)
        loop = StepLoop(cluster, data.dataset, checkpointer, spike, recorder, accounting,
                        failover if degrade else None, evaluator)
        first_step = start
        try:
            while True:
                try:
                    loop.run(start, data_offset=checkpointer.data_offset,
                             restarts=recovery.restarts + failover.failures)
                    checkpointer.collect(block=True)
                    break
                except PodFailure as failure:
                    if degrade:
                        start = failover.degrade(failure)
                    else:
                        start = recovery.recover(failure)
                except Divergence as diverged:
                    if degrade and diverged.outvoted:
                        start = failover.outvote(diverged)
                    else:       # no majority to trust: every pod back to the last checkpoint
                        out(f"{diverged}: restoring every pod to the last checkpoint")
                        events.write(EventKind.DIVERGED, step=diverged.step, why=str(diverged),
                                     checksums={str(p): c for p, c in diverged.checksums.items()})
                        start = recovery.recover(PodFailure(str(diverged)))
                except Spike as spiked:
                    start = recovery.rewind(spiked)
        finally:
            failover.close()
            if pool is not None:
                pool.close()
            recorder.close()
            checkpointer.collect(block=False)
    finally:
        events.close()
    records = recorder.in_order()
    # Steps trained more than once: a restore or rewind replays the steps after its checkpoint.
    lost = max(0, recorder.steps_written - len(records)) if records else 0
    extra = {"skipped_steps": len(recorder.skipped_steps), "restarts": recovery.restarts,
             "rewinds": recovery.rewinds, "failed_checkpoints": checkpointer.failed,
             "last_checkpoint": checkpointer.last_good.path if checkpointer.last_good else None,
             "on_pod_failure": config.recovery.on_pod_failure, "pod_failures": failover.failures + recovery.restarts,
             "lost_steps": lost, "degraded_s": failover.degraded_s, "rejoins": failover.rejoins,
             "hot_swaps": failover.hot_swaps, "outvoted": failover.outvoted, "realigned": failover.realigned,
             "state_transfer_bytes": failover.transfer_bytes, "state_transfer_s": failover.transfer_s,
             "first_step": first_step, "reattached": reattached is not None, "base_fingerprint": base_fingerprint}
    if extra["pod_failures"]:
        out(f"pod failures: {extra['pod_failures']} ({config.recovery.on_pod_failure} mode); steps trained more "
            f"than once: {lost}; {failover.degraded_s:.1f}s degraded; {failover.rejoins} rejoin(s), "
            f"{failover.transfer_bytes / 2**20:.1f} MiB of state transferred")
    return finish(config, cluster.live_clients[0], run_dir, data.tokenizer, evaluator.last, records, extra=extra)
