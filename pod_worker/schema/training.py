"""The sections of what a pod trains, and how, beside the model's: the optimizer, the pod's device
mesh, the run's shape (TrainShape) and prompt tuning (PromptConfig)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from multipod.model.config import ConfigError, PromptKind, to_enum
from multipod.pod_worker.schema.loader import non_negative, positive


class LrSchedule(enum.StrEnum):
    """optimizer.schedule: the learning rate's shape after its linear warmup (pod_worker/optimizer.py)."""
    COSINE = "cosine"       # cosine decay over the schedule's steps to learning_rate * min_lr_ratio
    # Warmup-stable-decay: the peak rate held, then a linear decay to learning_rate * min_lr_ratio
    # over the last decay_fraction of the schedule's steps. A run stopped in its stable phase
    # resumes with another length (the rates it ran are those of the longer run).
    WSD = "wsd"


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then a cosine (or warmup-stable-decay) schedule, and global-norm
    clipping."""
    learning_rate: float = 2e-2     # the default run's (docs/default_run.md)
    warmup_steps: int = 20
    decay_steps: int = 0          # the schedule's length; 0: the run's total steps
    min_lr_ratio: float = 0.1     # the schedule ends at learning_rate * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0        # 0 disables clipping
    schedule: LrSchedule = LrSchedule.COSINE
    decay_fraction: float = 0.2   # wsd: the share of the schedule's steps the final decay takes

    def __post_init__(self):
        object.__setattr__(self, "schedule", to_enum("optimizer.schedule", LrSchedule, self.schedule))

    def validate(self) -> None:
        positive("optimizer.learning_rate", self.learning_rate)
        non_negative("optimizer.warmup_steps", self.warmup_steps)
        non_negative("optimizer.decay_steps", self.decay_steps)
        non_negative("optimizer.weight_decay", self.weight_decay)
        non_negative("optimizer.clip_norm", self.clip_norm)
        positive("optimizer.eps", self.eps)
        for name in ("min_lr_ratio", "b1", "b2", "decay_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"optimizer.{name}", f"must be in [0, 1], got {value}")

    def decay_start(self, schedule_steps: int) -> int:
        """wsd: the first step of the final decay (the rate is the peak's before it, from the end
        of the warmup); the decay ends at schedule_steps."""
        return wsd_decay_start(schedule_steps, self.decay_fraction, self.warmup_steps)


def wsd_decay_start(schedule_steps: int, decay_fraction: float, warmup_steps: int) -> int:
    """The first step of a warmup-stable-decay schedule's final decay. The one place this step is
    computed: the schedule (pod_worker/optimizer.py) and the checkpoints' resume rule
    (checkpoint.py) use it."""
    return max(warmup_steps, schedule_steps - round(decay_fraction * schedule_steps))


@dataclass(frozen=True)
class MeshConfig:
    """A pod's device mesh (data x model). Every pod must end up with the same shape."""
    data: int = -1                # -1: every device not used by the model axis
    model: int = 1

    def validate(self) -> None:
        positive("mesh.model", self.model)
        if self.data != -1:
            positive("mesh.data", self.data)

    def resolve(self, num_devices: int) -> tuple[int, int]:
        """(data, model) for a pod with num_devices devices; ConfigError if they do not fit."""
        if num_devices % self.model:
            raise ConfigError("mesh.model", f"{self.model} does not divide the pod's {num_devices} devices")
        data = num_devices // self.model if self.data == -1 else self.data
        if data * self.model != num_devices:
            raise ConfigError("mesh.data", f"data={data} x model={self.model} != the pod's {num_devices} devices")
        return data, self.model


@dataclass(frozen=True)
class TrainShape:
    """What a pod needs to know about the run as a whole: the seed of its initial parameters, the
    length of the learning-rate schedule, and the shape of a global batch. The defaults are the
    default run's (docs/default_run.md); the controller's run.seed, run.steps, data.seq_len and
    data.global_batch take theirs from here."""
    seed: int = 0
    total_steps: int = 300        # the schedule decays over this many steps (unless decay_steps is set)
    seq_len: int = 128
    global_batch: int = 32        # sequences per step, over all pods

    def validate(self) -> None:
        non_negative("train.seed", self.seed)
        positive("train.total_steps", self.total_steps)
        positive("train.seq_len", self.seq_len)
        positive("train.global_batch", self.global_batch)


@dataclass(frozen=True)
class PromptConfig:
    """Prompt tuning / p-tuning (model/prompt.py): with a kind, the pod trains only the prompt
    parameters; the model is the frozen base read from base_checkpoint, and the optimizer, the
    DCN exchange, the checksum and the checkpoints carry the prompt parameters alone."""
    kind: PromptKind | None = None    # None (written ""): train the whole model
    virtual_tokens: int = 10      # virtual tokens before every sequence (they take context positions)
    hidden: int = 128             # the prompt encoder's hidden width ("mlp", "lstm")
    base_checkpoint: str = ""     # a checkpoint step folder of the base model, readable by every pod

    def __post_init__(self):
        kind = None if self.kind in (None, "") else to_enum("prompt.kind", PromptKind, self.kind)
        object.__setattr__(self, "kind", kind)

    @property
    def enabled(self) -> bool:
        return self.kind is not None

    def validate(self) -> None:
        if not self.enabled:
            return
        positive("prompt.virtual_tokens", self.virtual_tokens)
        positive("prompt.hidden", self.hidden)
        if not self.base_checkpoint:
            raise ConfigError("prompt.base_checkpoint", "prompt tuning needs the base model's checkpoint")

