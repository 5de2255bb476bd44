"""dcn.overlap: the choice (Overlap) and what it comes to for one pod's step (resolve_overlap), a
pure function of the config and the pod's batch, so every host of every pod decides alike."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multipod.pod_worker.schema.worker import WorkerConfig


class Overlap(enum.StrEnum):
    """dcn.overlap: whether the gradient step runs as per-layer programs (pod_worker/overlap.py),
    each block's gradient leaving the pod while the earlier blocks' backward pass still runs.
      auto   overlap wherever the layout can (resolve_overlap), else the fused step, said once;
      true   overlap, or a ConfigError naming dcn.overlap where the layout cannot;
      false  the fused step (pod_worker/programs.py make_grad_step) everywhere.
    TOML's booleans (`dcn.overlap = true`, also in configs written before "auto") load as true/false."""
    AUTO = "auto"
    ON = "true"
    OFF = "false"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        return None


# Why the overlapped step cannot run a prompt-tuning pod (resolve_overlap): the fused step's
# gradient is the prompt's few kilobytes, with nothing to hide behind the backward pass.
PROMPT_RUNS_FUSED = "prompt tuning runs the fused step (its gradient is a few kilobytes)"

# dcn.overlap = auto overlaps only where each per-layer program has work enough to pay for its own
# dispatch and launch, a fixed cost per program (some tenths of a millisecond on XLA CPU here): at
# least this many activations (rows x seq_len x d_model) per microbatch of a pod's step. Measured
# on this machine (docs/benchmarks.md): the overlapped step was slower at 2^15 and below (the tiny
# test model, and the default model on 1-2 rows), faster from 2^16 up.
AUTO_MIN_ACTIVATIONS = 1 << 16


def resolve_overlap(config: WorkerConfig, rows: int | None = None) -> tuple[bool, str]:
    """(whether a pod runs the overlapped step, why not if it does not), for a pod whose step takes
    `rows` sequences (default: the whole global batch, as on one pod). dcn.overlap = true and false
    decide alone (validation refuses true where the layout cannot overlap: prompt tuning); auto
    overlaps wherever the layout can (microbatches, pods of several hosts, degraded mode) unless
    the step is too small to gain (AUTO_MIN_ACTIVATIONS). A pure function of the config and the
    pod's batch, so every host of every pod decides alike, and a resumed run as the first did."""
    overlap = config.dcn.overlap
    if overlap is not Overlap.AUTO:
        return overlap is Overlap.ON, "" if overlap is Overlap.ON else "dcn.overlap = false"
    if config.prompt.enabled:
        return False, PROMPT_RUNS_FUSED
    rows = config.train.global_batch if rows is None else rows
    micro_rows = max(1, rows // config.model.microbatches)
    activations = micro_rows * config.train.seq_len * config.model.d_model
    if activations < AUTO_MIN_ACTIVATIONS:
        return False, (f"the step is too small for per-layer programs to pay: {micro_rows} rows x "
                       f"{config.train.seq_len} tokens x d_model {config.model.d_model} = {activations} activations "
                       f"per microbatch, under {AUTO_MIN_ACTIVATIONS}; dcn.overlap = true overlaps all the same")
    return True, ""
