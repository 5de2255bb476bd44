"""The run's typed configuration: dataclasses split by concern, loaded from TOML + overrides.

The controller resolves a Config from defaults, an optional TOML file (`--config`) and
`--set section.key=value` overrides. The sections the workers use (model, optimizer, mesh, dcn,
prompt) are the worker's published schema (pod_worker/schema/); `worker_config()` projects out
what a worker gets in Configure. The controller's own sections: data, run (the step loop), one
per component of the loop (checkpoint, eval, sample, recovery, health, spike: each component
gets its own) and generate. Every error names the offending field.
"""
from __future__ import annotations

import json
import pathlib
import tomllib
import typing
from dataclasses import dataclass, field

from multipod.controller.core.policies import OnPodFailure, OnSpike
from multipod.model.config import ConfigError, ModelConfig, to_enum
from multipod.pod_worker.schema import (
    DcnConfig,
    MeshConfig,
    OptimizerConfig,
    PromptConfig,
    SyncConfig,
    TrainShape,
    WorkerConfig,
    build,
    non_negative,
    plain,
    positive,
    validate_sections,
)

# A trained BPE (data.tokenizer = "bpe:N") has the 256 byte symbols, <|endoftext|> and at least
# one merge.
MIN_BPE_VOCAB = 258
MAX_BPE_VOCAB = 1 << 20

# The worker's sections (ModelConfig, OptimizerConfig, MeshConfig, DcnConfig, PromptConfig) are
# imported from where they live (model/config.py, pod_worker/schema/), not from here.
__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "GenerateConfig", "HealthConfig",
           "RecoveryConfig", "RunConfig", "SampleConfig", "SpikeConfig", "load_config", "parse_override", "upgrade"]


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from, how text becomes tokens, and how a global batch is shaped."""
    # A text file, a directory, a .jsonl or a .parquet; "" = the running Python's standard
    # library (.py files).
    path: str = ""
    text_field: str = "text"      # the field of a .jsonl record / the column of a .parquet holding the text
    # Prompt tuning (a [prompt] kind): data.path is a .jsonl of task examples, each an input and
    # the output the model should write after it; the loss counts the output tokens only.
    input_field: str = "input"
    output_field: str = "output"
    # "bytes" | "bpe:N" (a byte-level BPE of N tokens trained on the corpus, cached) | a path to a
    # Hugging Face tokenizer.json | a path to a SentencePiece model. The model's vocab_size follows
    # it, padded up to a multiple of 128, unless model.vocab_size is given.
    tokenizer: str = "bpe:2048"
    # Tokenized corpora and trained tokenizers; "" = $MULTIPOD_CACHE_DIR, else ~/.cache/multipod.
    cache_dir: str = ""
    seq_len: int = TrainShape.seq_len
    global_batch: int = TrainShape.global_batch   # sequences per step, over all pods
    # 0: the whole source, however large (the token cache is built once, in shards, and memory-
    # mapped). N > 0: the source's files in order up to N bytes on disk (the one that reaches N is
    # read whole; the rest are left out and reported), e.g. to try a run on a part of a corpus.
    max_bytes: int = 0

    def validate(self) -> None:
        positive("data.seq_len", self.seq_len)
        positive("data.global_batch", self.global_batch)
        non_negative("data.max_bytes", self.max_bytes)
        if self.path and not pathlib.Path(self.path).exists():
            raise ConfigError("data.path", f"{self.path!r} does not exist")
        for name in ("text_field", "input_field", "output_field"):
            if not getattr(self, name):
                raise ConfigError(f"data.{name}", "must not be empty")
        self.bpe_size()     # checks the bpe:N form
        if self.tokenizer != "bytes" and not self.tokenizer.startswith("bpe:") \
                and not pathlib.Path(self.tokenizer).is_file():
            raise ConfigError("data.tokenizer", f"{self.tokenizer!r} is not \"bytes\", \"bpe:N\" or an existing "
                              f"tokenizer file (a tokenizer.json or a SentencePiece model)")

    def bpe_size(self) -> int | None:
        """N of a "bpe:N" tokenizer (None for any other kind); ConfigError if N is not a valid size."""
        if not self.tokenizer.startswith("bpe:"):
            return None
        size = self.tokenizer[4:]
        if not size.isdigit() or not MIN_BPE_VOCAB <= int(size) <= MAX_BPE_VOCAB:
            raise ConfigError("data.tokenizer", f"{self.tokenizer!r}: bpe:N needs N in [{MIN_BPE_VOCAB}, "
                              f"{MAX_BPE_VOCAB}] (the 256 bytes, the end-of-text token and at least one merge)")
        return int(size)


@dataclass(frozen=True)
class RunConfig:
    """The step loop itself: its length and seed, its deadlines, what it measures."""
    steps: int = TrainShape.total_steps
    seed: int = TrainShape.seed
    peak_flops: float = 0.0       # per-device peak FLOP/s for MFU; 0 = unknown (MFU is null)
    # With no run.peak_flops and none cached for these devices, `multipod local` measures this
    # machine's peak once (a few seconds) and caches it for MFU; false: MFU stays unknown.
    measure_peak: bool = True
    # Every step's state checksum is taken on the devices; the fingerprint (BLAKE2b of a host copy
    # of the state) at every checkpoint and after every N steps (0: only at checkpoints).
    fingerprint_every: int = 100
    step_timeout_s: float = 120.0     # deadline of one Step RPC
    connect_timeout_s: float = 30.0   # how long to wait for a worker to answer at start
    configure_timeout_s: float = 300.0  # configure compiles the step: allow for it
    dispatch_depth: int = 2       # steps in flight at once (2: next shards travel during compute)

    def validate(self) -> None:
        positive("run.steps", self.steps)
        non_negative("run.seed", self.seed)
        non_negative("run.peak_flops", self.peak_flops)
        non_negative("run.fingerprint_every", self.fingerprint_every)
        for name in ("step_timeout_s", "connect_timeout_s", "configure_timeout_s"):
            positive(f"run.{name}", getattr(self, name))
        if self.dispatch_depth not in (1, 2):
            raise ConfigError("run.dispatch_depth", f"must be 1 or 2, got {self.dispatch_depth}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints (components/checkpointer.py, docs/reliability.md)."""
    every: int = 100              # save every N steps, at the start and at the end (0: only start and end)
    keep: int = 3                 # keep the newest k checkpoints
    dir: str = ""                 # "" = <run dir>/checkpoints; must be readable by every pod
    # DiLoCo --resume while this run has saved no checkpoint: the directory of an every-step run's
    # checkpoints whose newest one the pods warm-start from ("" = this run's own directory, `dir`).
    warm_start_from: str = ""

    def validate(self) -> None:
        non_negative("checkpoint.every", self.every)
        positive("checkpoint.keep", self.keep)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation on every pod (components/evaluation.py)."""
    every: int = 50               # evaluate every N steps (0: only at the end)
    batches: int = 2              # held-out batches per evaluation (0: none)

    def validate(self) -> None:
        non_negative("eval.every", self.every)
        non_negative("eval.batches", self.batches)


@dataclass(frozen=True)
class SampleConfig:
    """The sample the model writes at the end of a run (run/summary.py)."""
    tokens: int = 200             # its length (0: none)
    prompt: str = "def "
    temperature: float = 0.5      # 0: greedy

    def validate(self) -> None:
        non_negative("sample.tokens", self.tokens)
        non_negative("sample.temperature", self.temperature)


@dataclass(frozen=True)
class RecoveryConfig:
    """What a failed pod costs (components/failover.py, components/recovery.py)."""
    on_pod_failure: OnPodFailure = OnPodFailure.DEGRADE
    max_restarts: int = 3         # pod failures (either way) before the run gives up
    restart_timeout_s: float = 120.0  # how long to wait for a failed pod to serve again

    def __post_init__(self):
        object.__setattr__(self, "on_pod_failure",
                           to_enum("recovery.on_pod_failure", OnPodFailure, self.on_pod_failure))

    def validate(self) -> None:
        non_negative("recovery.max_restarts", self.max_restarts)
        positive("recovery.restart_timeout_s", self.restart_timeout_s)


@dataclass(frozen=True)
class HealthConfig:
    """How a dead or hung pod is found (cluster/pods.py's watchdog, the step loop)."""
    interval_s: float = 2.0       # the watchdog probes every pod's health this often
    timeout_s: float = 5.0        # a pod whose health check takes longer is hung
    progress_timeout_s: float = 0.0   # no step finished for this long: probe the pods (0: run.step_timeout_s)

    def validate(self) -> None:
        positive("health.interval_s", self.interval_s)
        positive("health.timeout_s", self.timeout_s)
        non_negative("health.progress_timeout_s", self.progress_timeout_s)


@dataclass(frozen=True)
class SpikeConfig:
    """The loss-spike policy (components/spike.py); non-finite steps are always skipped, on every
    pod alike. A spike: a loss above threshold x the mean of the last `window` losses."""
    policy: OnSpike = OnSpike.NONE
    threshold: float = 3.0
    window: int = 10
    skip_batches: int = 0         # on rewind, skip this many batches after the checkpoint

    def __post_init__(self):
        object.__setattr__(self, "policy", to_enum("spike.policy", OnSpike, self.policy))

    def validate(self) -> None:
        positive("spike.threshold", self.threshold)
        positive("spike.window", self.window)
        non_negative("spike.skip_batches", self.skip_batches)


# [run] keys of configs written before the run's components got sections of their own (a
# run_config.json beside old checkpoints): where each lives now.
MOVED_RUN_KEYS = {
    "checkpoint_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep", "checkpoint_dir": "checkpoint.dir",
    "eval_every": "eval.every", "eval_batches": "eval.batches",
    "sample_tokens": "sample.tokens", "sample_prompt": "sample.prompt", "sample_temperature": "sample.temperature",
    "on_pod_failure": "recovery.on_pod_failure", "max_restarts": "recovery.max_restarts",
    "restart_timeout_s": "recovery.restart_timeout_s",
    "health_interval_s": "health.interval_s", "health_timeout_s": "health.timeout_s",
    "progress_timeout_s": "health.progress_timeout_s",
    "on_spike": "spike.policy", "spike_threshold": "spike.threshold", "spike_window": "spike.window",
    "skip_batches": "spike.skip_batches",
    "full_fingerprint_every": "run.fingerprint_every",
}


def upgrade(data: dict) -> dict:
    """A config (nested dicts) written by an older version, its moved [run] keys put where they
    live now; anything else as it was. For files runs wrote (run_config.json, config.json): a
    config the user writes gets an error naming the new key instead (load_config)."""
    run = data.get("run")
    if not isinstance(run, dict):
        return data
    data = {name: dict(table) if isinstance(table, dict) else table for name, table in data.items()}
    for old, new in MOVED_RUN_KEYS.items():
        if old in run:
            section, key = new.split(".")
            data.setdefault(section, {}).setdefault(key, run[old])
            del data["run"][old]
    return data


@dataclass(frozen=True)
class GenerateConfig:
    """How `multipod generate --layout FILE` lays its pod out; `multipod tune --inference` writes
    the best it measured (its flags --devices, --model-parallel and --batch-size win over these)."""
    devices: int = 1              # simulated devices of the generating pod
    model_parallel: int = 1       # the mesh's model axis (the data axis takes the other devices)
    batch_size: int = 64          # prompts generated together

    def validate(self) -> None:
        for name in ("devices", "model_parallel", "batch_size"):
            positive(f"generate.{name}", getattr(self, name))
        if self.devices % self.model_parallel:
            raise ConfigError("generate.model_parallel", f"{self.model_parallel} does not divide generate.devices "
                              f"{self.devices}")


@dataclass(frozen=True)
class Config:
    """The whole resolved configuration of a run."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dcn: DcnConfig = field(default_factory=DcnConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def validate(self) -> Config:
        """Check every section and the cross-section rules (the worker's too: a bad overlap or
        prompt is refused on load, not only when a worker configures); return self."""
        validate_sections(self, "data.seq_len", self.data.seq_len)
        if self.checkpoint.warm_start_from and not self.sync.diloco:
            raise ConfigError("checkpoint.warm_start_from", "a warm start begins a DiLoCo run from an every-step "
                              "run's checkpoint: it needs sync.mode = \"diloco\"")
        return self

    def to_dict(self) -> dict:
        """Nested dicts of plain values (choices as strings), as config.json and TOML carry them."""
        return plain(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), as written to the run directory."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def worker_config(self) -> WorkerConfig:
        """The part of the config a pod worker gets in Configure (and nothing else)."""
        train = TrainShape(seed=self.run.seed, total_steps=self.run.steps, seq_len=self.data.seq_len,
                           global_batch=self.data.global_batch)
        return WorkerConfig(model=self.model, optimizer=self.optimizer, mesh=self.mesh, dcn=self.dcn,
                            prompt=self.prompt, sync=self.sync, train=train)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        """Build and validate a Config from nested dicts; unknown keys and bad types are errors."""
        return build(cls, data).validate()

    @classmethod
    def from_json(cls, text: str) -> Config:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"not valid JSON: {exc}") from None
        return cls.from_dict(data)


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


def read_section(path: str, section: str, cls):
    """Section `section` of the TOML file `path` as a validated `cls` (defaults where the file has
    none), the rest of the file unread. ConfigError naming the file or the field."""
    try:
        data = tomllib.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(path, "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, f"not valid TOML: {exc}") from None
    value = build(cls, data.get(section, {}), section)
    value.validate()
    return value


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (), given: set | None = None) -> Config:
    """Defaults <- TOML file <- overrides, validated. Errors name the file or the field. `given`,
    if passed, receives the "section.key" names the file or the overrides set (what the user
    chose, as against a default: model.vocab_size follows the tokenizer unless given)."""
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
    run = data.get("run")
    for key in run if isinstance(run, dict) else ():
        if key in MOVED_RUN_KEYS:     # a config written for an older version
            raise ConfigError(f"run.{key}", f"is {MOVED_RUN_KEYS[key]} now")
    if given is not None:
        given.update(f"{section}.{key}" for section, table in data.items() if isinstance(table, dict)
                     for key in table)
    return Config.from_dict(data)
