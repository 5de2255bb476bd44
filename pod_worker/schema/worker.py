"""WorkerConfig, everything a pod worker uses, as Configure carries it (canonical JSON, its hash,
what a checkpoint's state depends on), and the rules that span its sections (validate_sections)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from multipod.model.config import ConfigError, ModelConfig
from multipod.pod_worker.schema.dcn import DcnConfig
from multipod.pod_worker.schema.loader import build, plain
from multipod.pod_worker.schema.overlap import PROMPT_RUNS_FUSED, Overlap
from multipod.pod_worker.schema.sync import SyncConfig
from multipod.pod_worker.schema.training import LrSchedule, MeshConfig, OptimizerConfig, PromptConfig, TrainShape


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
        # The schedule as it runs, once: decay_steps = 0 (the run's steps) and decay_steps = N are
        # the same schedule when the run has N steps, so a finished run can train on past its end
        # with its schedule kept (optimizer.decay_steps = its steps).
        optimizer = {k: v for k, v in plain(self.optimizer).items() if k != "decay_steps"}
        if self.optimizer.schedule is LrSchedule.COSINE:
            # As the keys of checkpoints written before wsd existed (checkpoint.check_compatible
            # reads a key without a schedule as cosine); decay_fraction changes no cosine rate.
            del optimizer["schedule"], optimizer["decay_fraction"]
        key = {"model": plain(self.model), "optimizer": optimizer,
               "schedule_steps": self.schedule_steps, "seed": self.train.seed,
               "seq_len": self.train.seq_len, "global_batch": self.train.global_batch}
        if self.prompt.enabled:
            # The base is not here: which base a prompt belongs to is checked by its fingerprint
            # (the prompt checkpoint records it), whatever folder it is read from.
            key["prompt"] = {"kind": self.prompt.kind.value, "virtual_tokens": self.prompt.virtual_tokens,
                             "hidden": self.prompt.hidden}
        if self.sync.diloco:    # the outer state and where each pod is in the cycle
            # Not the replay's memory budget, which changes no value.
            key["sync"] = {k: v for k, v in plain(self.sync).items() if k != "replay_history_mb"}
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

