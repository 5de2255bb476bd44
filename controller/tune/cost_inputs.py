"""The inputs of the cross-pod cost model (cost.py): the model's shape, the cluster's layout, the
chip, the links and the Calibration of the terms that are not arithmetic (each with validate():
ConfigError naming the field), and one sync candidate (SyncChoice). Pure Python, as cost.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from multipod.model.config import ConfigError, ModelConfig
from multipod.pod_worker.schema import MAX_STREAMS, Compression, SyncConfig, SyncMode

DEFAULT_CHUNK_BYTES = 2 << 20        # dcn.chunk_bytes' default
_LOSSINESS = {"none": 0, "float32": 0, "bf16": 1, "int8": 2, "int4": 3}


def check_number(name: str, value, low: float = 0.0, strict: bool = True) -> None:
    """ConfigError(name) unless value is a finite number > low (>= low if not strict)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if value < low or (strict and value == low):
        raise ConfigError(name, f"must be {'>' if strict else '>='} {low:g}, got {value:g}")


def check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Calibration:
    """The model's terms that are not arithmetic. Defaults are estimates, each with its source;
    runs measured on this machine are to replace them (issue 23: calibrate, state the error)."""
    backward_ratio: float = 2.0         # backward / forward FLOPs: 4N against 2N per token (6N accounting)
    dcn_efficiency: float = 0.93        # data-plane throughput / link rate: DESIGN.md, pyzmq zero-copy at
    #                                     0.93 of raw TCP (103 MB each way, loopback, this machine)
    stream_window_bytes: float = 4 * 2**20   # bytes in flight per TCP stream (assumed: Linux's autotuned
    #                                     window of a few MiB); one stream carries at most window / RTT
    program_launch_s: float = 3e-4      # per per-layer program of the overlapped step: "some tenths of a
    #                                     millisecond" on XLA CPU here (pod_worker/schema/overlap.py); ~0 on TPU
    block0_recompute_layers: float = 0.25    # overlap.py runs block 0's backward as two programs that
    #                                     recompute about one MLP matmul: a quarter of a block's backward
    update_s: float = 0.0               # AdamW + checksum per step, beyond what the MFU already counts
    outer_update_s: float = 0.0         # DiLoCo: pseudo-gradient and outer step per outer sync
    chunk_overhead_s: float = 0.0       # per chunk on the host (framing, queueing); 0: not modelled
    host_values_per_s: dict = field(default_factory=dict)   # compression -> values/s the host encodes,
    #                                     decodes and sums (pipelined with the sending); absent: not modelled
    jitter_cv: float = 0.0              # a pod's step-time standard deviation / mean: every-step sync waits
    #                                     for the slowest pod, E[max of N normals] sigmas; 0: not modelled
    step_overhead_s: float = 0.0        # per step of a real run beyond compute, update and the exchange: the
    #                                     controller's step RPCs, waiting for the slower pod, pods sharing
    #                                     cores; 0: not modelled (`tune --dcn` measures it: a calibration run)

    def validate(self) -> None:
        check_number("backward_ratio", self.backward_ratio)
        check_number("dcn_efficiency", self.dcn_efficiency)
        if self.dcn_efficiency > 1:
            raise ConfigError("dcn_efficiency", f"must be at most 1, got {self.dcn_efficiency:g}")
        check_number("stream_window_bytes", self.stream_window_bytes)
        for name in ("program_launch_s", "block0_recompute_layers", "update_s", "outer_update_s",
                     "chunk_overhead_s", "jitter_cv", "step_overhead_s"):
            check_number(name, getattr(self, name), strict=False)
        for key, rate in self.host_values_per_s.items():
            check_number(f"host_values_per_s.{key}", rate)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model: its size, FLOPs, layers, the bytes of one gradient
    value as a pod holds it (4 for float32 parameters, 2 for bfloat16), and the share of the
    gradient that is ready only when the backward pass ends (what overlap cannot hide)."""
    params: int
    flops_per_token: float
    n_layers: int
    grad_bytes: int = 4
    last_ready_fraction: float = 0.0

    @classmethod
    def from_config(cls, model: ModelConfig, seq_len: int) -> ModelShape:
        """model/config.py's counts; the last-ready share is the embedding plus block 0 without
        its MLP (overlap.py's readiness order)."""
        n, d = model.param_count(), model.d_model
        block0 = (n - model.vocab_size * d - d) / model.n_layers - 3 * d * model.mlp_dim
        return cls(n, model.flops_per_token(seq_len), model.n_layers, 2 if model.param_dtype == "bfloat16" else 4,
                   (model.vocab_size * d + block0) / n)

    @classmethod
    def from_params(cls, params: int, n_layers: int, grad_bytes: int = 4,
                    flops_per_token: float | None = None) -> ModelShape:
        """A parameter count alone: 6N FLOPs per token (no attention term) unless given, and one
        block's share of the gradient left for after the backward pass (an assumption)."""
        # validate() refuses n_layers < 1, naming it; the share is not computed from it meanwhile.
        return cls(params, 6.0 * params if flops_per_token is None else flops_per_token, n_layers, grad_bytes,
                   1.0 / n_layers if n_layers > 0 else 1.0)

    def validate(self) -> None:
        check_count("params", self.params)
        check_number("flops_per_token", self.flops_per_token)
        check_count("layers", self.n_layers)
        if self.grad_bytes not in (2, 4):
            raise ConfigError("grad_dtype", f"gradient values take 2 (bfloat16) or 4 (float32) bytes, "
                                            f"got {self.grad_bytes}")
        check_number("last_ready_fraction", self.last_ready_fraction, strict=False)


@dataclass(frozen=True)
class Layout:
    """The cluster's shape: pods of hosts of chips, the tokens of one global step (over all pods),
    microbatches per pod step, the pod mesh's model axis, and whether the pod shards the gradient
    fully over its chips (as PaLM and MaxText do; multipod replicates it over the data axis, so
    its hosts gather the summed blocks over ICI after the exchange)."""
    pods: int
    hosts_per_pod: int
    chips_per_pod: int
    tokens_per_step: int
    microbatches: int = 1
    model_parallel: int = 1
    fully_sharded: bool = False

    @property
    def tokens_per_pod(self) -> float:
        return self.tokens_per_step / self.pods

    def validate(self) -> None:
        for name in ("pods", "hosts_per_pod", "chips_per_pod", "tokens_per_step", "microbatches", "model_parallel"):
            check_count(name, getattr(self, name))
        if self.chips_per_pod % self.hosts_per_pod:
            raise ConfigError("chips_per_pod", f"{self.chips_per_pod} chips do not split evenly over "
                                               f"{self.hosts_per_pod} hosts")
        if self.chips_per_pod % self.model_parallel:
            raise ConfigError("model_parallel", f"a model axis of {self.model_parallel} does not divide the pod's "
                                                f"{self.chips_per_pod} chips")


@dataclass(frozen=True)
class Chip:
    peak_flops: float      # per chip, FLOP/s
    mfu: float             # expected model FLOPs utilisation of one pod's step, a fraction

    def validate(self) -> None:
        check_number("peak_flops", self.peak_flops)
        check_number("mfu", self.mfu)
        if self.mfu > 1:
            raise ConfigError("mfu", f"is a fraction in (0, 1] (0.462 for 46.2%), got {self.mfu:g}")


@dataclass(frozen=True)
class Links:
    """dcn_gbps: one pod's DCN bandwidth each way (the sum over its hosts' links, each host sending its
    block of the gradient; `tune --dcn` measures every host at once: its hosts x the slowest's), Gb/s;
    dcn_latency_ms: one way; ici_gbps: one chip's ICI bandwidth; streams: data-plane connections
    per peer (dcn.streams)."""
    dcn_gbps: float
    dcn_latency_ms: float
    ici_gbps: float
    ici_latency_ms: float = 0.001
    streams: int = 4

    def validate(self) -> None:
        check_number("dcn_gbps", self.dcn_gbps)
        check_number("ici_gbps", self.ici_gbps)
        check_number("dcn_latency_ms", self.dcn_latency_ms, strict=False)
        check_number("ici_latency_ms", self.ici_latency_ms, strict=False)
        if not isinstance(self.streams, int) or not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError("streams", f"must be an integer in [1, {MAX_STREAMS}], got {self.streams!r}")


@dataclass(frozen=True)
class SyncChoice:
    """One candidate: [dcn] overlap and compression for every-step sync, or [sync] for DiLoCo;
    streams (None: the links') and chunk size for both."""
    overlap: bool = False
    compression: Compression = Compression.NONE
    sync: SyncConfig = SyncConfig()
    streams: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @property
    def lossy(self) -> bool:
        """Whether it changes the math (compression, DiLoCo): the tier chosen only if allowed."""
        return self.sync.diloco or self.compression is not Compression.NONE

    def lossiness(self) -> tuple:
        """How far from exact every-step sync, for breaking near-ties: none < compressed every step
        (bf16 < int8 < int4) < DiLoCo (by H, then outer dtype, then fragments)."""
        if self.sync.diloco:
            s = self.sync
            return 2, s.inner_steps, _LOSSINESS[s.outer_dtype.value], s.fragments
        return (1, _LOSSINESS[self.compression.value]) if self.lossy else (0,)

    def label(self) -> str:
        if self.sync.diloco:
            s = self.sync
            return (f"DiLoCo H={s.inner_steps} F={s.fragments} tau={s.overlap_steps} {s.outer_dtype.value}")
        return f"every step, {'overlapped' if self.overlap else 'fused'}, {self.compression.value}"

    def settings(self) -> dict:
        """The [dcn] and [sync] keys that run it (a config's `--set` values)."""
        dcn: dict = {"chunk_bytes": self.chunk_bytes} if self.streams is None else \
            {"streams": self.streams, "chunk_bytes": self.chunk_bytes}
        if not self.sync.diloco:
            dcn.update(overlap=self.overlap, compression=self.compression.value)
            return {"dcn": dcn, "sync": {"mode": SyncMode.EVERY_STEP.value}}
        s = self.sync
        return {"dcn": dcn, "sync": {"mode": s.mode.value, "inner_steps": s.inner_steps, "fragments": s.fragments,
                                     "overlap_steps": s.overlap_steps, "outer_dtype": s.outer_dtype.value}}
