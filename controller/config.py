"""The run's typed configuration: dataclasses split by concern, loaded from TOML + overrides.

This is the one config loader. The controller resolves a Config from defaults, an optional TOML
file (`--config`) and `--set section.key=value` overrides; it is sent to every worker as JSON and
each worker parses it with the same code. Every error names the offending field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import tomllib
import typing
from dataclasses import dataclass, field

from model.config import ConfigError, ModelConfig

__all__ = ["Config", "ConfigError", "DataConfig", "DcnConfig", "MeshConfig", "ModelConfig",
           "OptimizerConfig", "RunConfig", "load_config", "parse_override"]


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay, and global-norm clipping."""
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int = 0          # 0: decay over run.steps
    min_lr_ratio: float = 0.1     # the cosine decays to learning_rate * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0        # 0 disables clipping

    def validate(self) -> None:
        _positive("optimizer.learning_rate", self.learning_rate)
        _non_negative("optimizer.warmup_steps", self.warmup_steps)
        _non_negative("optimizer.decay_steps", self.decay_steps)
        _non_negative("optimizer.weight_decay", self.weight_decay)
        _non_negative("optimizer.clip_norm", self.clip_norm)
        _positive("optimizer.eps", self.eps)
        for name in ("min_lr_ratio", "b1", "b2"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"optimizer.{name}", f"must be in [0, 1], got {value}")


@dataclass(frozen=True)
class MeshConfig:
    """A pod's device mesh (data x model). Every pod must end up with the same shape."""
    data: int = -1                # -1: every device not used by the model axis
    model: int = 1

    def validate(self) -> None:
        _positive("mesh.model", self.model)
        if self.data != -1:
            _positive("mesh.data", self.data)

    def resolve(self, num_devices: int) -> tuple[int, int]:
        """(data, model) for a pod with num_devices devices; ConfigError if they do not fit."""
        if num_devices % self.model:
            raise ConfigError("mesh.model", f"{self.model} does not divide the pod's {num_devices} devices")
        data = num_devices // self.model if self.data == -1 else self.data
        if data * self.model != num_devices:
            raise ConfigError("mesh.data", f"data={data} x model={self.model} != the pod's {num_devices} devices")
        return data, self.model


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how a global batch is shaped."""
    path: str = ""                # "" = the running Python's standard library (.py files)
    seq_len: int = 128
    global_batch: int = 16        # sequences per step, over all pods

    def validate(self) -> None:
        _positive("data.seq_len", self.seq_len)
        _positive("data.global_batch", self.global_batch)
        if self.path and not pathlib.Path(self.path).exists():
            raise ConfigError("data.path", f"{self.path!r} does not exist")


@dataclass(frozen=True)
class DcnConfig:
    """The cross-pod gradient link."""
    chunk_bytes: int = 2 << 20    # gradient chunk size on the wire, 1-4 MiB
    timeout_s: float = 60.0       # deadline for a peer's gradient to arrive
    streams: int = 4              # parallel gRPC streams per peer and step, 1-8 (at most 6 / (pods - 1) are used)
    compression: str = "none"     # "none" | "bf16" | "int8" (int8: one scale per chunk)
    link_gbps: float = 0.0        # slow-link mode: simulated egress bandwidth per pod (0: off)
    link_latency_ms: float = 0.0  # slow-link mode: simulated one-way latency (0: off)

    def validate(self) -> None:
        from protos import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError("dcn.chunk_bytes",
                              f"must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        _positive("dcn.timeout_s", self.timeout_s)
        if not 1 <= self.streams <= 8:
            raise ConfigError("dcn.streams", f"must be in [1, 8], got {self.streams}")
        if self.compression not in ("none", "bf16", "int8"):
            raise ConfigError("dcn.compression", f"must be one of none, bf16, int8; got {self.compression!r}")
        _non_negative("dcn.link_gbps", self.link_gbps)
        _non_negative("dcn.link_latency_ms", self.link_latency_ms)


@dataclass(frozen=True)
class RunConfig:
    """The step loop: length, seed, deadlines, reporting."""
    steps: int = 200
    seed: int = 0
    peak_flops: float = 0.0       # per-device peak FLOP/s for MFU; 0 = unknown (MFU is null)
    step_timeout_s: float = 120.0     # deadline of one Step RPC
    connect_timeout_s: float = 30.0   # how long to wait for a worker to answer at start
    configure_timeout_s: float = 300.0  # configure compiles the step: allow for it
    dispatch_depth: int = 2       # steps in flight at once (2: next shards travel during compute)
    sample_tokens: int = 160      # length of the sample printed at the end (0: none)
    sample_prompt: str = "def "
    eval_batches: int = 2         # held-out batches evaluated at the end (0: none)
    # Checkpoints and recovery (docs/reliability.md).
    checkpoint_every: int = 100   # save every N steps and at the end (0: only at the end)
    keep_checkpoints: int = 3     # keep the newest k checkpoints
    checkpoint_dir: str = ""      # "" = <run dir>/checkpoints; must be readable by every pod
    max_restarts: int = 3         # recoveries from a failed/hung pod before the run gives up
    restart_timeout_s: float = 120.0  # how long to wait for a failed pod to serve again
    health_interval_s: float = 2.0    # the watchdog probes every pod's health this often
    health_timeout_s: float = 5.0     # a pod whose health check takes longer is hung
    progress_timeout_s: float = 0.0   # no step finished for this long: probe the pods (0: step_timeout_s)
    # Training-health policy: non-finite steps are always skipped (on every pod alike).
    on_spike: str = "none"        # "none" | "rewind": restore the checkpoint before a loss spike
    spike_threshold: float = 3.0  # a spike: loss > threshold x mean of the last spike_window losses
    spike_window: int = 10
    skip_batches: int = 0         # on rewind, skip this many batches after the checkpoint
    # TEST ONLY, for exercising the health policy (-1: off): pod debug_poison_pod's gradient is
    # NaN at step debug_nan_step; the controller records a 1000x loss for the step that trains
    # on batch debug_spike_step (a "bad batch": skipped batches do not spike again).
    debug_poison_pod: int = -1
    debug_nan_step: int = -1
    debug_spike_step: int = -1

    def validate(self) -> None:
        _positive("run.steps", self.steps)
        for name in ("checkpoint_every", "max_restarts", "skip_batches"):
            _non_negative(f"run.{name}", getattr(self, name))
        for name in ("keep_checkpoints", "restart_timeout_s", "health_interval_s", "health_timeout_s",
                     "spike_threshold", "spike_window"):
            _positive(f"run.{name}", getattr(self, name))
        _non_negative("run.progress_timeout_s", self.progress_timeout_s)
        if self.on_spike not in ("none", "rewind"):
            raise ConfigError("run.on_spike", f"must be none or rewind, got {self.on_spike!r}")
        _non_negative("run.seed", self.seed)
        _non_negative("run.peak_flops", self.peak_flops)
        for name in ("step_timeout_s", "connect_timeout_s", "configure_timeout_s"):
            _positive(f"run.{name}", getattr(self, name))
        if self.dispatch_depth not in (1, 2):
            raise ConfigError("run.dispatch_depth", f"must be 1 or 2, got {self.dispatch_depth}")
        _non_negative("run.sample_tokens", self.sample_tokens)
        _non_negative("run.eval_batches", self.eval_batches)


@dataclass(frozen=True)
class Config:
    """The whole resolved configuration of a run."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dcn: DcnConfig = field(default_factory=DcnConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "Config":
        """Check every section and the cross-section rules; return self."""
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError("data.seq_len", f"{self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): what workers receive and what config_hash covers."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def config_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        """Build and validate a Config from nested dicts; unknown keys and bad types are errors."""
        if not isinstance(data, dict):
            raise ConfigError("config", f"expected a table, got {type(data).__name__}")
        sections = {}
        known = {f.name: f for f in dataclasses.fields(cls)}
        for name, value in data.items():
            if name not in known:
                raise ConfigError(name, f"unknown section; known sections: {', '.join(known)}")
            section_cls = typing.get_type_hints(cls)[name]
            sections[name] = _build_section(section_cls, name, value)
        return cls(**sections).validate()

    @classmethod
    def from_json(cls, text: str) -> "Config":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"not valid JSON: {exc}") from None
        return cls.from_dict(data)


def _build_section(section_cls, section: str, value):
    if not isinstance(value, dict):
        raise ConfigError(section, f"expected a table, got {type(value).__name__}")
    hints = typing.get_type_hints(section_cls)
    kwargs = {}
    for key, raw in value.items():
        name = f"{section}.{key}"
        if key not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(section_cls))
            raise ConfigError(name, f"unknown key; {section} has: {known}")
        kwargs[key] = _coerce(name, hints[key], raw)
    return section_cls(**kwargs)


def _coerce(name: str, kind, raw):
    """Check raw against the field's type; ints are accepted where floats are expected."""
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if kind is int and isinstance(raw, bool) or not isinstance(raw, kind):
        raise ConfigError(name, f"expected {kind.__name__}, got {type(raw).__name__} {raw!r}")
    return raw


def _positive(name: str, value) -> None:
    if not value > 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def _non_negative(name: str, value) -> None:
    if not value >= 0:
        raise ConfigError(name, f"must be >= 0, got {value}")


def parse_override(text: str) -> tuple[list[str], object]:
    """Parse `section.key=value`; the value is a TOML literal, or a bare string if it is not one."""
    if "=" not in text:
        raise ConfigError(text, "override must look like section.key=value")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(key, "override key must be section.key, e.g. model.d_model")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return path, parsed


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- TOML file <- overrides, validated. Errors name the file or the field."""
    data: dict = {}
    if path:
        try:
            data = tomllib.loads(pathlib.Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError("--config", f"no such file: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None
    for text in overrides:
        (section, key), value = parse_override(text)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(section, "is not a table")
        table[key] = value
    return Config.from_dict(data)
