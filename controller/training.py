"""A training run from start to summary: connect and configure the pods, resume or take a
baseline, then run the step loop, handing pod failures and loss spikes to recovery, until
run.steps steps are done; then evaluate, sample and summarise.

The pieces each own one job: cluster.py (the pods), loop.py (the steps), checkpointer.py,
spike.py, recovery.py, metrics.py, events.py, summary.py."""
from __future__ import annotations

import concurrent.futures
import json
import pathlib

from multipod.controller.checkpointer import Checkpointer
from multipod.controller.cluster import Cluster, connect
from multipod.controller.config import Config, ConfigError
from multipod.controller.data import Batches, load_corpus
from multipod.controller.errors import PodFailure, RunError
from multipod.controller.events import EventLog
from multipod.controller.loop import StepLoop
from multipod.controller.metrics import Accounting, MetricsLog, ProgressLine, Recorder, load_measured_peak, out
from multipod.controller.recovery import Recovery
from multipod.controller.spike import Spike, SpikePolicy
from multipod.controller.summary import Summary, finish, print_summary

__all__ = ["PodFailure", "RunError", "Summary", "checkpoint_dir", "print_summary", "run_training", "train"]


def checkpoint_dir(config: Config, run_dir: pathlib.Path) -> str:
    """Where the run's checkpoints go (absolute: the workers may run in another directory)."""
    return str(pathlib.Path(config.run.checkpoint_dir or run_dir / "checkpoints").absolute())


def run_training(config: Config, addresses: list[str], run_dir: pathlib.Path,
                 progress: ProgressLine | None = None, resume: bool = False, supervisor=None) -> Summary:
    """Train for config.run.steps steps on the pods at `addresses`; returns the run summary.

    resume: continue from the newest checkpoint in the checkpoint directory. supervisor: an
    object with kill(pod) that gets a hung pod restarted (LocalPods); without one, the controller
    waits for the user's supervisor to bring a failed worker back."""
    if not addresses:
        raise ConfigError("--workers", "no worker addresses given")
    num_pods = len(addresses)
    if config.data.global_batch % num_pods:
        raise ConfigError("data.global_batch", f"{config.data.global_batch} does not split over {num_pods} pods")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")

    # Load the corpus while the workers get ready.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        corpus = pool.submit(load_corpus, config.data.path)
        cluster = connect(addresses, config)
        try:
            tokens = corpus.result()
        except BaseException:
            cluster.close()
            raise
    try:
        batches = Batches(tokens, config.data.seq_len, config.data.global_batch, config.run.seed)
        return train(cluster, run_dir, batches, progress, resume, supervisor)
    finally:
        cluster.close()


def _accounting(cluster: Cluster, replies) -> Accounting:
    """Configure's replies, reported to the user, as the accounting of every step's record."""
    config, first = cluster.config, replies[0]
    num_devices = sum(r.num_devices for r in replies)
    accounting = Accounting(model_flops_per_token=config.model.flops_per_token(config.data.seq_len),
                            peak_flops=config.run.peak_flops or load_measured_peak(first.device_kind, num_devices),
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
        + (f"{peak / 1e9:.1f} GFLOP/s per device" if peak else "unknown (MFU not reported; see `multipod peak-flops`)"))
    return accounting


def train(cluster: Cluster, run_dir: pathlib.Path, batches: Batches, progress: ProgressLine | None = None,
          resume: bool = False, supervisor=None) -> Summary:
    """Configure `cluster`, then train to run.steps, recovering from pod failures and rewinding
    loss spikes; returns the run summary."""
    config, run = cluster.config, cluster.config.run
    out(f"configuring {cluster.size} pod(s): compiling the step (this takes a while the first time)")
    replies = cluster.configure()
    accounting = _accounting(cluster, replies)
    events = EventLog(run_dir / "events.jsonl")
    checkpointer = Checkpointer(cluster, checkpoint_dir(config, run_dir), events)
    spike = SpikePolicy(run)
    recovery = Recovery(cluster, checkpointer, spike, events, supervisor)
    try:
        if resume:
            start = checkpointer.resume()
            out(f"resumed from {checkpointer.last_good.path} (step {start}, "
                f"data position {start + checkpointer.data_offset})")
            if start > run.steps:
                raise ConfigError("run.steps", f"{run.steps} is behind the checkpoint's step {start}; "
                                  f"resume with --steps {start} or more")
        else:
            start = int(replies[0].step)   # the checkpointer takes a baseline at this first boundary
        recorder = Recorder(MetricsLog(run_dir, append=resume), progress or ProgressLine(run.steps, start))
        loop = StepLoop(cluster, batches, checkpointer, spike, recorder, accounting)
        try:
            while True:
                try:
                    loop.run(start, data_offset=checkpointer.data_offset, restarts=recovery.restarts)
                    checkpointer.collect(block=True)
                    break
                except PodFailure as failure:
                    start = recovery.recover(failure)
                except Spike as spiked:
                    start = recovery.rewind(spiked)
        finally:
            recorder.close()
            checkpointer.collect(block=False)
    finally:
        events.close()
    extra = {"skipped_steps": len(recorder.skipped_steps), "restarts": recovery.restarts,
             "rewinds": recovery.rewinds, "failed_checkpoints": checkpointer.failed,
             "last_checkpoint": checkpointer.last_good.path if checkpointer.last_good else None}
    return finish(run, cluster.clients[0], run_dir, batches, recorder.in_order(), extra=extra)
