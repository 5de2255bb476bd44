"""The grid of `multipod tune`: the layouts one pod may use, and the argument types that narrow it.

A candidate is one layout of a pod: a (data x model) mesh of its devices, sequence parallelism on
or off, a microbatch count and a remat policy. enumerate_candidates builds the grid from the
model's shape and the pod's batch; values the user asks for explicitly are taken as given, so an
impossible one is tried and reported with its error rather than silently dropped.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multipod.model.config import RematPolicy

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# Microbatch counts the grid tries when none are asked for (those that split a data shard evenly).
MICROBATCH_COUNTS = (1, 2, 4, 8)
# The dimensions the model axis splits (Megatron-style tensor parallelism).
SHARDED_DIMS = ("n_heads", "mlp_dim", "vocab_size")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout of a pod."""
    data: int
    model: int
    sequence_parallel: bool
    microbatches: int
    remat: RematPolicy

    def label(self) -> str:
        """A short human-readable name, e.g. 'mesh 1x2 sp=on microbatches=1 remat=none'."""
        return (f"mesh {self.data}x{self.model} sp={'on' if self.sequence_parallel else 'off'} "
                f"microbatches={self.microbatches} remat={self.remat}")


# -- argument types ----------------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1.5GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; positive integers only."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_remat_list(text: str) -> list[RematPolicy]:
    """'none,full' -> [RematPolicy.NONE, RematPolicy.FULL]; every name must be a RematPolicy."""
    from multipod.model.config import RematPolicy  # here: building the CLI parser must not import jax
    values = [v.strip() for v in text.split(",") if v.strip()]
    names = [policy.value for policy in RematPolicy]
    if not values or any(v not in names for v in values):
        raise argparse.ArgumentTypeError(f"remat policies are {', '.join(names)}; got {text!r}")
    return [RematPolicy(v) for v in values]


def parse_mesh_list(text: str) -> list[tuple[int, int]]:
    """'2x2,4x1' -> [(2, 2), (4, 1)] as (data, model)."""
    meshes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise argparse.ArgumentTypeError(f"meshes look like DATAxMODEL, e.g. 2x2,4x1; got {part!r}")
        meshes.append((int(match.group(1)), int(match.group(2))))
    return meshes


# -- the grid ----------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_meshes(model_cfg, devices: int) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (data, model) mesh of `devices` whose model axis divides what tensor parallelism
    splits (SHARDED_DIMS); why the others are out. Training and inference tuning both start here."""
    meshes, skipped = [], []
    for model in _divisors(devices):
        data = devices // model
        bad = [f"{name}={getattr(model_cfg, name)}" for name in SHARDED_DIMS if getattr(model_cfg, name) % model]
        if bad:
            skipped.append(f"mesh {data}x{model}: model={model} does not divide {', '.join(bad)}")
        else:
            meshes.append((data, model))
    return meshes, skipped


def _meshes(model_cfg, per_pod_batch: int, devices: int) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (data, model) mesh of `devices` the model and the batch allow; why the others are out."""
    allowed, skipped = model_meshes(model_cfg, devices)
    meshes = []
    for data, model in allowed:
        if per_pod_batch % data:
            skipped.append(f"mesh {data}x{model}: data={data} does not divide the pod's batch of {per_pod_batch}")
        else:
            meshes.append((data, model))
    return meshes, skipped


def enumerate_candidates(model_cfg, per_pod_batch: int, devices: int, meshes=None, microbatches=None,
                         remats=None, sequence_parallel: str = "both") -> tuple[list[Candidate], list[str]]:
    """The grid of candidates, and one line per layout the heuristic left out (and why).

    meshes, microbatches and remats, when given, are used as they are (no filtering);
    sequence_parallel is 'both', 'on' or 'off' ('both' means off only where the model axis is 1:
    with one model shard it is the same program)."""
    skipped: list[str] = []
    if meshes is None:
        meshes, skipped = _meshes(model_cfg, per_pod_batch, devices)
    from multipod.model.config import RematPolicy
    remats = list(remats or RematPolicy)
    candidates = []
    for data, model in meshes:
        if microbatches is None:
            rows = per_pod_batch // data if per_pod_batch % data == 0 else 0
            counts = [k for k in MICROBATCH_COUNTS if rows and rows % k == 0]
        else:
            counts = list(microbatches)
        sp_values = {"both": (False, True), "on": (True,), "off": (False,)}[sequence_parallel]
        if model == 1 and sequence_parallel == "both":
            sp_values = (False,)
        for sp in sp_values:
            for k in counts:
                for remat in remats:
                    candidates.append(Candidate(data, model, sp, k, remat))
    return candidates, skipped


def candidate_config(base, candidate: Candidate):
    """The run config (controller.config.Config) with a candidate's layout applied; not validated,
    so an impossible requested value reaches the probe and comes back as that candidate's error."""
    from multipod.pod_worker.schema import MeshConfig
    model = dataclasses.replace(base.model, sequence_parallel=candidate.sequence_parallel,
                                microbatches=candidate.microbatches, remat=candidate.remat)
    return dataclasses.replace(base, model=model, mesh=MeshConfig(data=candidate.data, model=candidate.model))


def candidate_worker_json(base, candidate: Candidate) -> str:
    """What the layout probe gets for one candidate: its pod's WorkerConfig as JSON."""
    return candidate_config(base, candidate).worker_config().to_json()
