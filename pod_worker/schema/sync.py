"""The sync section: how the pods' parameters meet, every step or by DiLoCo's outer steps
(SyncConfig, and its choices: SyncMode, OuterOptimizer, OuterDtype, OuterFailure)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from multipod.model.config import ConfigError, to_enum
from multipod.pod_worker.schema.dcn import Compression
from multipod.pod_worker.schema.loader import non_negative, positive


class SyncMode(enum.StrEnum):
    """sync.mode: how the pods' parameters meet."""
    EVERY_STEP = "every_step"   # the gradient is summed over the pods every step (DESIGN.md invariant 1)
    DILOCO = "diloco"           # (Streaming) DiLoCo: inner steps on each pod, outer steps on fragments


class OuterOptimizer(enum.StrEnum):
    """sync.outer_optimizer: the update the averaged pseudo-gradient drives (pod_worker/diloco.py)."""
    NESTEROV = "nesterov"       # SGD with Nesterov momentum (the DiLoCo papers' choice)
    SGD = "sgd"                 # SGD, with heavy-ball momentum if sync.outer_momentum > 0


class OuterDtype(enum.StrEnum):
    """sync.outer_dtype: how an outer gradient travels; summed in float32 whatever the encoding."""
    FLOAT32 = "float32"
    BF16 = "bf16"
    INT8 = "int8"               # one float32 scale per block of <= 256 values
    INT4 = "int4"               # two values per byte, one float32 scale per block of <= 256 values

    @property
    def compression(self) -> Compression:
        """The data plane's encoding of it (pod_worker/dcn/wire.py)."""
        return Compression.NONE if self is OuterDtype.FLOAT32 else Compression(self.value)


class OuterFailure(enum.StrEnum):
    """sync.on_pod_failure: what an outer step does when a pod died since the last one."""
    REPLAY = "replay"           # a survivor recomputes its inner steps: bitwise the uninterrupted run
    DROP = "drop"               # the outer step averages over the pods that finished


@dataclass(frozen=True)
class SyncConfig:
    """How the pods stay in step. every_step: today's exact data parallelism over the DCN.
    diloco: Streaming DiLoCo (Douillard et al. 2023; Douillard et al. 2025): each pod takes inner
    steps on its own shard with its own optimizer state; the parameters are cut into `fragments`
    contiguous groups of layers, and fragment f meets every `inner_steps` (H) steps, at its own
    offset in the cycle: the pods average its pseudo-gradient (the last agreed values minus their
    own), encoded in `outer_dtype`, and apply one outer step. With `overlap_steps` (tau) the
    exchange runs on the data plane while tau more inner steps go on; the fragment then takes the
    outer step's result. After a fragment's outer step its values and the outer state are bitwise
    identical on every pod."""
    mode: SyncMode = SyncMode.EVERY_STEP
    inner_steps: int = 20               # H: inner steps between two outer steps of a fragment
    outer_optimizer: OuterOptimizer = OuterOptimizer.NESTEROV
    outer_lr: float = 0.7               # the DiLoCo paper's
    outer_momentum: float = 0.9
    fragments: int = 1                  # F: 1 is DiLoCo; more is Streaming DiLoCo
    overlap_steps: int = 0              # tau: inner steps a fragment's exchange overlaps (< H / F)
    outer_dtype: OuterDtype = OuterDtype.FLOAT32
    on_pod_failure: OuterFailure = OuterFailure.REPLAY
    # "replay": host memory each pod may hold for the outer steps since its checkpoint before last
    # (pod_worker/diloco_replicas.py); beyond it the pod forgets them rather than run out of memory.
    replay_history_mb: int = 2048

    def __post_init__(self):
        for name, kind in (("mode", SyncMode), ("outer_optimizer", OuterOptimizer), ("outer_dtype", OuterDtype),
                           ("on_pod_failure", OuterFailure)):
            object.__setattr__(self, name, to_enum(f"sync.{name}", kind, getattr(self, name)))

    @property
    def diloco(self) -> bool:
        return self.mode is SyncMode.DILOCO

    @property
    def period(self) -> int:
        """Inner steps between two consecutive outer steps (of successive fragments): H / F."""
        return self.inner_steps // self.fragments

    def pending_after(self, count: int) -> bool:
        """DiLoCo: whether an outer sync has started and is not yet applied after `count` inner
        steps (a pod's state moves to another only when none is)."""
        return self.diloco and count >= self.period and count % self.period < self.overlap_steps

    def validate(self) -> None:
        positive("sync.inner_steps", self.inner_steps)
        positive("sync.fragments", self.fragments)
        positive("sync.outer_lr", self.outer_lr)
        non_negative("sync.overlap_steps", self.overlap_steps)
        positive("sync.replay_history_mb", self.replay_history_mb)
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError("sync.outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        if self.outer_optimizer is OuterOptimizer.NESTEROV and self.outer_momentum == 0.0:
            raise ConfigError("sync.outer_momentum", "Nesterov needs a momentum > 0 (outer_optimizer = \"sgd\" "
                                                     "takes none)")
        if self.inner_steps % self.fragments:
            raise ConfigError("sync.fragments", f"{self.fragments} fragments do not divide sync.inner_steps = "
                                                f"{self.inner_steps}: each fragment meets once every H steps, at "
                                                f"offsets H / F apart")
        if self.overlap_steps and self.overlap_steps >= self.period:
            raise ConfigError("sync.overlap_steps", f"{self.overlap_steps} must be below sync.inner_steps / "
                                                    f"sync.fragments = {self.period}: a fragment's exchange must end "
                                                    f"before the next fragment's starts")

