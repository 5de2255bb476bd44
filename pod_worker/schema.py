"""The worker's part of the run configuration: the schema a pod worker publishes.

The controller resolves the user's config (controller/core/run_config.py), projects out a WorkerConfig and
sends it as JSON in Configure; the worker parses and validates only this. The worker never sees
the data path, evaluation, sampling, recovery or spike policy, so a remote worker does not care
what exists on the controller's disk. This module is the only part of pod_worker the controller
imports; it starts nothing (no devices, no server).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from dataclasses import dataclass, field

from multipod.model.config import ConfigError, ModelConfig, PromptKind, to_enum
from multipod.protos import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES


class Compression(enum.StrEnum):
    """Gradient encodings on the DCN link (pod_worker/dcn/wire.py implements them)."""
    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"     # one scale per block of <= 256 values
    INT4 = "int4"     # two values per byte, one scale per block of <= 256 values


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

# Data-plane connections (ZeroMQ streams) per peer, at most.
MAX_STREAMS = 8


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay, and global-norm clipping."""
    learning_rate: float = 2e-2     # the default run's (docs/default_run.md)
    warmup_steps: int = 20
    decay_steps: int = 0          # 0: decay over the run's total steps
    min_lr_ratio: float = 0.1     # the cosine decays to learning_rate * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0        # 0 disables clipping

    def validate(self) -> None:
        positive("optimizer.learning_rate", self.learning_rate)
        non_negative("optimizer.warmup_steps", self.warmup_steps)
        non_negative("optimizer.decay_steps", self.decay_steps)
        non_negative("optimizer.weight_decay", self.weight_decay)
        non_negative("optimizer.clip_norm", self.clip_norm)
        positive("optimizer.eps", self.eps)
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
class DcnConfig:
    """The cross-pod gradient link."""
    chunk_bytes: int = 2 << 20    # gradient chunk size on the wire, 1-4 MiB
    timeout_s: float = 60.0       # deadline for a peer's gradient to arrive
    streams: int = 4              # parallel data-plane connections per peer
    compression: Compression = Compression.NONE
    link_gbps: float = 0.0        # slow-link mode: simulated egress bandwidth per pod (0: off)
    link_latency_ms: float = 0.0  # slow-link mode: simulated one-way latency (0: off)
    encrypt: bool = False         # refuse peers whose data plane is not CURVE-encrypted (worker --dcn-encrypt)
    overlap: Overlap = Overlap.AUTO   # per-layer backward programs; each block's gradient leaves when ready

    def __post_init__(self):
        object.__setattr__(self, "compression", to_enum("dcn.compression", Compression, self.compression))
        object.__setattr__(self, "overlap", to_enum("dcn.overlap", Overlap, self.overlap))

    def validate(self) -> None:
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError("dcn.chunk_bytes",
                              f"must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        positive("dcn.timeout_s", self.timeout_s)
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError("dcn.streams", f"must be in [1, {MAX_STREAMS}], got {self.streams}")
        non_negative("dcn.link_gbps", self.link_gbps)
        non_negative("dcn.link_latency_ms", self.link_latency_ms)


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


def validate_sections(config, seq_len_field: str, seq_len: int) -> None:
    """Validate every section of a config dataclass (the worker's, or the controller's whole one),
    then the rules that span the sections the worker uses: the sequences fit the model's context
    (with a prompt's virtual tokens), and overlap and prompt tuning accept the rest."""
    for section in dataclasses.fields(config):
        getattr(config, section.name).validate()
    check_fits(seq_len_field, seq_len, config.model, config.prompt)
    check_prompt(config.prompt, config.dcn, config.model)
    check_sync(config.sync, config.model, config.prompt)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a pod worker uses: model, optimizer, mesh, DCN link and the run's shape."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dcn: DcnConfig = field(default_factory=DcnConfig)
    train: TrainShape = field(default_factory=TrainShape)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def validate(self) -> WorkerConfig:
        validate_sections(self, "train.seq_len", self.train.seq_len)
        return self

    @property
    def schedule_steps(self) -> int:
        """Steps the learning-rate schedule decays over."""
        return self.optimizer.decay_steps or self.train.total_steps

    def state_key(self) -> dict:
        """Every value the pod's training state depends on (shapes, the update's maths, the
        schedule, the initial parameters): a checkpoint resumes bitwise only if they all match."""
        key = {"model": plain(self.model), "optimizer": plain(self.optimizer),
               "schedule_steps": self.schedule_steps, "seed": self.train.seed,
               "seq_len": self.train.seq_len, "global_batch": self.train.global_batch}
        if self.prompt.enabled:
            # The base is not here: which base a prompt belongs to is checked by its fingerprint
            # (the prompt checkpoint records it), whatever folder it is read from.
            key["prompt"] = {"kind": self.prompt.kind.value, "virtual_tokens": self.prompt.virtual_tokens,
                             "hidden": self.prompt.hidden}
        if self.sync.diloco:    # the outer state and where each pod is in the cycle
            key["sync"] = plain(self.sync)
        return key

    def exchange_dcn(self) -> DcnConfig:
        """The data plane's settings for what the pods exchange: every step's gradient in
        dcn.compression, or in DiLoCo mode the outer gradients in sync.outer_dtype."""
        if not self.sync.diloco:
            return self.dcn
        return dataclasses.replace(self.dcn, compression=self.sync.outer_dtype.compression)

    def to_dict(self) -> dict:
        return plain(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): what Configure carries and what config_hash covers."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def config_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"not valid JSON: {exc}") from None
        return build(cls, data).validate()


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


def check_fits(name: str, seq_len: int, model: ModelConfig, prompt: PromptConfig | None = None) -> None:
    """ConfigError(name) unless sequences of seq_len (after the prompt's virtual tokens, if any)
    fit the model's positions."""
    virtual = prompt.virtual_tokens if prompt is not None and prompt.enabled else 0
    if seq_len + virtual > model.max_seq_len:
        after = f" after prompt.virtual_tokens={virtual}" if virtual else ""
        raise ConfigError(name, f"{seq_len}{after} exceeds model.max_seq_len={model.max_seq_len}")


def check_sync(sync: SyncConfig, model: ModelConfig, prompt: PromptConfig) -> None:
    """ConfigError naming the field if DiLoCo cannot run with these settings."""
    if not sync.diloco:
        return
    if prompt.enabled:
        raise ConfigError("sync.mode", "prompt tuning syncs every step (its gradient is a few kilobytes)")
    if sync.fragments > model.n_layers:
        raise ConfigError("sync.fragments", f"{sync.fragments} fragments of contiguous layers, the model has "
                                            f"{model.n_layers} layers")


def check_prompt(prompt: PromptConfig, dcn: DcnConfig, model: ModelConfig) -> None:
    """ConfigError naming the field if prompt tuning cannot run with these settings."""
    if not prompt.enabled:
        return
    if dcn.overlap is Overlap.ON:
        raise ConfigError("dcn.overlap", f"{PROMPT_RUNS_FUSED}: leave it at auto (or false) with prompt.kind")
    if model.microbatches != 1:
        raise ConfigError("model.microbatches", f"prompt tuning runs unsplit batches, got {model.microbatches}")


# -- the typed loader and writer (the controller's config uses them too) ---------------------------
def plain(config) -> dict:
    """A config dataclass as nested dicts of plain values, as JSON and TOML carry them: a choice
    as its string, None as "" (TOML has no null; `build` reads "" back as None)."""
    return dataclasses.asdict(config, dict_factory=_plain_items)


def _plain_items(items) -> dict:
    return {key: "" if value is None else value.value if isinstance(value, enum.Enum) else value
            for key, value in items}


def build(cls, data, prefix: str = ""):
    """An instance of dataclass `cls` from nested dicts: unknown keys and wrong types are
    ConfigErrors naming the field (e.g. "model.d_modle: unknown key; model has: ...").
    Not validated: call .validate() on the result."""
    where = prefix or "config"
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, raw in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in hints:
            if prefix:
                raise ConfigError(name, f"unknown key; {prefix} has: {', '.join(known)}")
            raise ConfigError(name, f"unknown section; known sections: {', '.join(known)}")
        kind = hints[key]
        kwargs[key] = build(kind, raw, name) if dataclasses.is_dataclass(kind) else _coerce(name, kind, raw)
    return cls(**kwargs)


def _coerce(name: str, kind, raw):
    """Check raw against the field's type; ints are accepted where floats are expected, a choice's
    string where an enum is (ConfigError listing the choices), "" where None is."""
    options = typing.get_args(kind)
    if type(None) in options:     # an optional field: "X | None"
        if raw in ("", None):
            return None
        (kind,) = [option for option in options if option is not type(None)]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return to_enum(name, kind, raw)
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if (kind is int and isinstance(raw, bool)) or not isinstance(raw, kind):
        raise ConfigError(name, f"expected {kind.__name__}, got {type(raw).__name__} {raw!r}")
    return raw


def positive(name: str, value) -> None:
    """ConfigError(name) unless value > 0."""
    if not value > 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def non_negative(name: str, value) -> None:
    """ConfigError(name) unless value >= 0."""
    if not value >= 0:
        raise ConfigError(name, f"must be >= 0, got {value}")
