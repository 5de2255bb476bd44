"""The record of one training step: StepRecord, and PodTimings for each live pod's part of it.

This module is the schema of metrics.jsonl, the one place it is written down (README.md and
docs/architecture.md point here): a step's line is the JSON of StepRecord.to_dict()
(dataclasses.asdict: one key per field below, `pods` a list of PodTimings objects). Units: seconds
for every `*_s`, bytes for `*bytes*`, tokens are target tokens (the positions the loss counts).
Timings are measured by the pods (StepReply.timings) except step_time_s, the controller's.

Evaluation records (controller/components/evaluation.py: step, trained_steps, eval_loss, ...) share
the file; a step's line is the one with a "loss". StepRecord.from_json reads a line back, checking
every field's type; it ignores keys it does not know, and reads files written before the
checksum/fingerprint renaming (protocol 6: "fingerprints" were the checksums, "full_fingerprints"
the fingerprints) under the new names.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodTimings:
    """One live pod's part of a step, from its StepReply."""
    pod: int                    # the pod's index
    compute_s: float            # forward + backward on the pod's mesh
    exchange_s: float           # the DCN exchange: its gradient out, its peers' in
    # From the end of this pod's backward pass until every summed leaf is on its devices: the part
    # of the exchange the step waits for (with dcn.overlap the exchange starts during the backward).
    exposed_exchange_s: float
    update_s: float             # the pod-order sum, host -> device, the optax update
    wait_s: float               # waiting for the previous step to finish (pipelining)
    checksum_s: float           # the state checksum after the update (on the devices)
    fingerprint_s: float = 0.0  # the fingerprint (BLAKE2b of a host copy); 0 on steps without one
    idle_s: float               # the part of exchange_s spent waiting on peers' chunks
    # The part of idle_s before every peer's first chunk had landed: waiting on a pod still
    # computing (a straggler), not on the link. 0.0 in files written before it was recorded.
    peer_wait_s: float = 0.0
    # The part of idle_s after a peer's chunk had landed during the wait: bytes on the wire. 0.0 in
    # files written before it was recorded.
    wire_wait_s: float = 0.0
    dcn_bytes_sent: int         # bytes this pod put on the data plane, after compression, before packing
    dcn_packed: bool = False    # its chunks went zstd-packed (dcn.lossless): fewer bytes crossed the link


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One finished training step: what metrics.jsonl holds per step (see the module docstring).
    The phase times are the slowest pod's: the step waits for it in each phase."""
    step: int                   # the step's index (the state after it has trained step + 1 steps)
    # Mean loss per target token over the global batch: every shard's loss_sum (cross-entropy +
    # z-loss), summed in slot order, over `tokens`; a degraded step reports the healthy step's loss.
    loss: float
    z_loss: float               # the z-loss part of `loss`, likewise
    hosts: tuple[int, ...]      # hosts[slot]: the pod that computed slot's shard
    live_pods: int              # pods that took part; fewer than len(hosts): a degraded step
    grad_norm: float            # global norm of the summed (all-pod) gradient
    learning_rate: float        # the learning rate of this step's update
    skipped: bool               # the update was skipped (non-finite summed gradient), on every pod
    checksums: tuple[str, ...]  # per live pod, the state checksum after the step (equal on every pod)
    # Per live pod, the fingerprint (BLAKE2b of a host copy of the state) on the steps that took
    # one (every run.fingerprint_every steps); None on the others.
    fingerprints: tuple[str, ...] | None = None
    step_time_s: float          # the controller's time from the previous step's end to this one's (0: partial)
    compute_time_s: float       # the PodTimings fields of the same name without "_time", at most over the pods
    exchange_time_s: float
    update_time_s: float
    idle_time_s: float
    exposed_exchange_s: float
    checksum_time_s: float
    fingerprint_time_s: float = 0.0
    pods: tuple[PodTimings, ...]  # the live pods' own timings, in reply order
    dcn_bytes_sent: int         # over all pods
    tokens: int                 # target tokens of the shards counted (every shard unless partial_loss)
    tokens_per_s: float         # tokens / step_time_s (0 when step_time_s is 0)
    model_flops_per_token: float  # the model's FLOPs per token, forward + backward (model/flops.py)
    mfu: float | None           # model FLOP/s over the devices' peak; None without a known peak
    hardware_flops_per_token: float | None  # what the compiled step executes (XLA, recompute included); None: unknown
    hfu: float | None           # hardware FLOP/s over the devices' peak; None if either is unknown
    time: float                 # Unix time when the record was made
    data_index: int             # the batch the step trained on (step + the data offset of skipped batches)
    epoch: float                # epochs of the training split done after this step
    skipped_steps: int          # steps of the run skipped so far, this one included
    restarts: int               # pod failures the run had recovered from when the step ran
    hot_swaps: int = 0          # failed slots taken by a spare at another address before the step ran
    # A step the survivors finished while a pod failed: loss and tokens count only the shards
    # whose results came back; its state is checked as any step's.
    partial_loss: bool = False
    # DiLoCo (sync.mode = "diloco"): the outer step this step applied, if any: its sync number,
    # the fragment of layers, and (slowest pod) the seconds from the start of its exchange until
    # applied and the part of them the inner steps waited for. Its bytes are in dcn_bytes_sent.
    outer_sync: int | None = None
    outer_fragment: int | None = None
    outer_seconds: float = 0.0
    outer_exposed_s: float = 0.0
    outer_pods: tuple[int, ...] | None = None   # the pods it averaged (fewer than all: a pod was dropped)

    def to_dict(self) -> dict[str, Any]:
        """The record as metrics.jsonl holds it (tuples become lists in JSON)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """One line of metrics.jsonl (without the newline)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, line: str | Mapping[str, Any]) -> StepRecord:
        """A record from a metrics.jsonl line (text, or the parsed object). ValueError naming the
        field if one is missing or of the wrong type; unknown keys are ignored."""
        data = json.loads(line) if isinstance(line, str) else line
        if not isinstance(data, Mapping):
            raise ValueError(f"a step record must be a JSON object, got {type(data).__name__}")
        data = _renamed(data)
        if isinstance(data.get("pods"), (list, tuple)):
            data["pods"] = [_build(PodTimings, p, "pods[].") if isinstance(p, Mapping) else p for p in data["pods"]]
        return _build(cls, data, "")


_Record = TypeVar("_Record", "StepRecord", "PodTimings")

# Before protocol 7 the checksums were called fingerprints, and the fingerprints full fingerprints;
# fingerprint_time_s (and a pod's fingerprint_s) timed the checksum, plus the fingerprint when taken.
_OLD_NAMES = {"fingerprints": "checksums", "full_fingerprints": "fingerprints",
              "fingerprint_time_s": "checksum_time_s"}


def _renamed(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with the keys of an older file under their current names."""
    data = dict(data)
    if "checksums" in data or "fingerprints" not in data:
        return data
    data = {_OLD_NAMES.get(key, key): value for key, value in data.items()}
    if isinstance(data.get("pods"), (list, tuple)):
        data["pods"] = [{("checksum_s" if k == "fingerprint_s" else k): v for k, v in p.items()}
                        if isinstance(p, Mapping) else p for p in data["pods"]]
    return data


def _build(cls: type[_Record], data: Mapping[str, Any], where: str) -> _Record:
    """cls(**the known keys of data), each value checked against its field's type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"a {cls.__name__} without {', '.join(where + m for m in missing)}")
    values = {}
    for name in fields:
        if name in data:
            values[name] = _typed(data[name], hints[name], where + name)
    return cls(**values)


def _typed(value: Any, hint: Any, name: str) -> Any:
    """`value` as type `hint` (JSON lists become tuples); ValueError naming the field if it is not one."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"{name} is null")
    for option in options:
        origin = typing.get_origin(option)
        if origin is tuple and isinstance(value, (list, tuple)):
            item = typing.get_args(option)[0]
            return tuple(_typed(v, item, f"{name}[]") for v in value)
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if isinstance(option, type) and dataclasses.is_dataclass(option) and isinstance(value, option):
            return value
    raise ValueError(f"{name} is {type(value).__name__} {value!r}, not {_name(hint)}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
