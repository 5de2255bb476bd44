"""The worker's part of the run configuration: the schema a pod worker publishes.

The controller resolves the user's config (controller/core/run_config.py), projects out a WorkerConfig and
sends it as JSON in Configure; the worker parses and validates only this. The worker never sees
the data path, evaluation, sampling, recovery or spike policy, so a remote worker does not care
what exists on the controller's disk. This package is the only part of pod_worker the controller
imports; it starts nothing (no devices, no server).

Every name is imported from here (`multipod.pod_worker.schema.X`); one module per concern:
  worker     WorkerConfig, what Configure carries, and the rules that span its sections
  training   the optimizer, mesh, train (TrainShape) and prompt sections
  dcn        the dcn section (DcnConfig), its encodings (Compression), packing (Lossless) and
             streams per peer (streams_per_peer: what "auto" comes to on this host)
  overlap    dcn.overlap (Overlap) and what it comes to for one pod's step (resolve_overlap)
  sync       the sync section (SyncConfig): every step, or DiLoCo's outer steps
  loader     the typed loader and writer of every config dataclass (build, plain), and the value checks
  caches     where both sides keep their caches (default_cache_root, COMPILED)
"""
from multipod.pod_worker.schema.caches import COMPILED, default_cache_root
from multipod.pod_worker.schema.dcn import (
    MAX_AUTO_STREAMS,
    MAX_STREAMS,
    Compression,
    DcnConfig,
    Lossless,
    streams_for_cpus,
    streams_per_peer,
    this_host_cpus,
)
from multipod.pod_worker.schema.loader import build, non_negative, plain, positive
from multipod.pod_worker.schema.overlap import AUTO_MIN_ACTIVATIONS, PROMPT_RUNS_FUSED, Overlap, resolve_overlap
from multipod.pod_worker.schema.sync import OuterDtype, OuterFailure, OuterOptimizer, SyncConfig, SyncMode
from multipod.pod_worker.schema.training import LrSchedule, MeshConfig, OptimizerConfig, PromptConfig, TrainShape
from multipod.pod_worker.schema.worker import (
    WorkerConfig,
    check_fits,
    check_prompt,
    check_sync,
    validate_sections,
)

__all__ = [
    "AUTO_MIN_ACTIVATIONS", "COMPILED", "MAX_AUTO_STREAMS", "MAX_STREAMS", "PROMPT_RUNS_FUSED", "Compression",
    "DcnConfig", "Lossless", "LrSchedule", "MeshConfig", "OptimizerConfig", "OuterDtype", "OuterFailure",
    "OuterOptimizer", "Overlap", "PromptConfig", "SyncConfig", "SyncMode", "TrainShape", "WorkerConfig", "build",
    "default_cache_root", "check_fits", "check_prompt", "check_sync", "non_negative", "plain", "positive",
    "resolve_overlap", "streams_for_cpus", "streams_per_peer", "this_host_cpus", "validate_sections",
]
