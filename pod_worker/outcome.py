"""What one training step on a pod reports (PodTrainer.train_step), and the update's part of it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multipod.pod_worker.dcn.exchange import ExchangeStats


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    learning_rate: float


@dataclass
class StepOutcome:
    """What one training step did on this pod, and how long each part took."""
    loss_sum: float           # cross-entropy + z-loss, summed over this pod's target tokens
    z_loss_sum: float
    tokens: int               # target tokens in this pod's shard
    grad_norm: float          # global norm of the summed (all-pod) gradient
    learning_rate: float
    skipped: bool             # the update was skipped (non-finite summed gradient)
    checksum: str             # the state checksum after the step (programs.state_checksum, on the devices)
    compute_s: float
    exchange_s: float
    update_s: float
    checksum_s: float
    link: ExchangeStats | None    # the exchange's statistics, None for one pod
    exposed_exchange_s: float = 0.0  # end of this pod's backward pass -> every summed leaf on its devices
    fingerprint: str = ""            # BLAKE2b of a host copy of the state, when the step was asked for it
    fingerprint_s: float = 0.0       # the time it took (0 if not taken)
    # Degraded mode: every shard computed, own first (None for own), as (slot, loss_sum, z_loss_sum, tokens).
    shards: list = field(default_factory=list)
    outer: object | None = None      # DiLoCo: the outer step this step applied (diloco.OuterReport), if any
