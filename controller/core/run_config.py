"""The run's typed configuration: dataclasses split by concern, loaded from TOML + overrides.

The controller resolves a Config from defaults, an optional TOML file (`--config`) and
`--set section.key=value` overrides. The sections the workers use (model, optimizer, mesh, dcn)
are the worker's published schema (pod_worker/schema.py); `worker_config()` projects out what a
worker gets in Configure. The controller validates only what it uses: data, run and the
cross-section rules. Every error names the offending field.
"""
from __future__ import annotations

import dataclasses
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
    TrainShape,
    WorkerConfig,
    build,
    check_fits,
    check_overlap,
    check_prompt,
    non_negative,
    plain,
    positive,
)

# A trained BPE (data.tokenizer = "bpe:N") has the 256 byte symbols, <|endoftext|> and at least
# one merge.
MIN_BPE_VOCAB = 258
MAX_BPE_VOCAB = 1 << 20

# The worker's sections (ModelConfig, OptimizerConfig, MeshConfig, DcnConfig, PromptConfig) are
# imported from where they live (model/config.py, pod_worker/schema.py), not from here.
__all__ = ["Config", "ConfigError", "DataConfig", "GenerateConfig", "RunConfig", "load_config", "parse_override"]


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

    def validate(self) -> None:
        positive("data.seq_len", self.seq_len)
        positive("data.global_batch", self.global_batch)
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
    """The step loop: length, seed, deadlines, reporting."""
    steps: int = TrainShape.total_steps
    seed: int = TrainShape.seed
    peak_flops: float = 0.0       # per-device peak FLOP/s for MFU; 0 = unknown (MFU is null)
    step_timeout_s: float = 120.0     # deadline of one Step RPC
    connect_timeout_s: float = 30.0   # how long to wait for a worker to answer at start
    configure_timeout_s: float = 300.0  # configure compiles the step: allow for it
    dispatch_depth: int = 2       # steps in flight at once (2: next shards travel during compute)
    sample_tokens: int = 200      # length of the sample printed at the end (0: none)
    sample_prompt: str = "def "
    sample_temperature: float = 0.5   # 0: greedy
    eval_batches: int = 2         # held-out batches per evaluation (0: none)
    eval_every: int = 50          # evaluate every N steps, on every pod (0: only at the end)
    # With no run.peak_flops and none cached for these devices, `multipod local` measures this
    # machine's peak once (a few seconds) and caches it for MFU; false: MFU stays unknown.
    measure_peak: bool = True
    # Every step's state checksum is taken on the devices; the fingerprint (BLAKE2b of a host copy
    # of the state) at every checkpoint and after every N steps (0: only at checkpoints).
    fingerprint_every: int = 100
    # Checkpoints and recovery (docs/reliability.md).
    checkpoint_every: int = 100   # save every N steps and at the end (0: only at the end)
    keep_checkpoints: int = 3     # keep the newest k checkpoints
    checkpoint_dir: str = ""      # "" = <run dir>/checkpoints; must be readable by every pod
    # A failed pod: "degrade" (its shard goes to the survivors, bitwise as if nothing happened,
    # and it rejoins from a live peer) or "restore" (every pod back to the last checkpoint).
    on_pod_failure: OnPodFailure = OnPodFailure.DEGRADE
    max_restarts: int = 3         # pod failures (either mode) before the run gives up
    restart_timeout_s: float = 120.0  # how long to wait for a failed pod to serve again
    health_interval_s: float = 2.0    # the watchdog probes every pod's health this often
    health_timeout_s: float = 5.0     # a pod whose health check takes longer is hung
    progress_timeout_s: float = 0.0   # no step finished for this long: probe the pods (0: step_timeout_s)
    # Training-health policy: non-finite steps are always skipped (on every pod alike).
    on_spike: OnSpike = OnSpike.NONE  # rewind: restore the checkpoint before a loss spike
    spike_threshold: float = 3.0  # a spike: loss > threshold x mean of the last spike_window losses
    spike_window: int = 10
    skip_batches: int = 0         # on rewind, skip this many batches after the checkpoint

    def __post_init__(self):
        object.__setattr__(self, "on_pod_failure", to_enum("run.on_pod_failure", OnPodFailure, self.on_pod_failure))
        object.__setattr__(self, "on_spike", to_enum("run.on_spike", OnSpike, self.on_spike))

    def validate(self) -> None:
        positive("run.steps", self.steps)
        for name in ("checkpoint_every", "max_restarts", "skip_batches", "fingerprint_every"):
            non_negative(f"run.{name}", getattr(self, name))
        for name in ("keep_checkpoints", "restart_timeout_s", "health_interval_s", "health_timeout_s",
                     "spike_threshold", "spike_window"):
            positive(f"run.{name}", getattr(self, name))
        non_negative("run.progress_timeout_s", self.progress_timeout_s)
        non_negative("run.seed", self.seed)
        non_negative("run.peak_flops", self.peak_flops)
        for name in ("step_timeout_s", "connect_timeout_s", "configure_timeout_s"):
            positive(f"run.{name}", getattr(self, name))
        if self.dispatch_depth not in (1, 2):
            raise ConfigError("run.dispatch_depth", f"must be 1 or 2, got {self.dispatch_depth}")
        non_negative("run.sample_tokens", self.sample_tokens)
        non_negative("run.sample_temperature", self.sample_temperature)
        non_negative("run.eval_batches", self.eval_batches)
        non_negative("run.eval_every", self.eval_every)


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
    prompt: PromptConfig = field(default_factory=PromptConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    def validate(self) -> Config:
        """Check every section and the cross-section rules; return self."""
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        check_fits("data.seq_len", self.data.seq_len, self.model, self.prompt)
        check_overlap(self.dcn, self.model)   # refused on load, not only when a worker configures
        check_prompt(self.prompt, self.dcn, self.model)
        return self

    def to_dict(self) -> dict:
        """Nested dicts of plain values (choices as strings), as config.json and TOML carry them."""
        return plain(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), as written to the run directory."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def worker_config(self) -> WorkerConfig:
        """The part of the config a pod worker gets in Configure (and nothing else)."""
        return WorkerConfig(model=self.model, optimizer=self.optimizer, mesh=self.mesh, dcn=self.dcn,
                            prompt=self.prompt, train=TrainShape(seed=self.run.seed, total_steps=self.run.steps,
                                             seq_len=self.data.seq_len, global_batch=self.data.global_batch))

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
    if given is not None:
        given.update(f"{section}.{key}" for section, table in data.items() if isinstance(table, dict)
                     for key in table)
    return Config.from_dict(data)
