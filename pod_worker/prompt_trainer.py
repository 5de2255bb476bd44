"""A pod that tunes a prompt (prompt.kind: prompt tuning or p-tuning, model/prompt.py) on a frozen
base model.

It is a PodTrainer whose trained state is the prompt parameters alone: the optimizer, the DCN
exchange (a few kilobytes per step), the per-step checksum, the checkpoints and the state transfer
to a rejoining pod all carry them and nothing else, through the very code of full training. The
base model is read from prompt.base_checkpoint onto the pod's mesh, laid out by the rules table,
and is an input of the programs, never an output: nothing can change it. Its fingerprint (BLAKE2b
of its parameters, taken once at load) is reported at configure and recorded in every prompt
checkpoint, with the on-device checksum of the base taken at load and again at that save (cheap:
no host copy of the base), so each checkpoint shows the base unchanged; a prompt checkpoint is
restored only onto a pod holding the same base.

Batches carry a loss mask [rows, seq_len]: the loss counts a task's output tokens only.

On a pod of several hosts every host loads the base laid out over the whole pod (it holds whole
parameters: the model axis stays inside a host) and puts its own rows of a step's batch and mask
on its devices; the pod's count of targets is then summed on the devices, inside the step.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from multipod.model import ModelConfig, abstract_params
from multipod.model.config import LAYOUT_FIELDS, ConfigError
from multipod.model.partitioning import activate_rules, param_shardings
from multipod.model.prompt import init_prompt as init_prompt_params, prompt_embeddings, sampled_vocab_init
from multipod.pod_worker import checkpoint, programs
from multipod.pod_worker.diloco import outer_restore_template
from multipod.pod_worker.generation import Generator
from multipod.pod_worker.hosts import host_value
from multipod.pod_worker.optimizer import make_optimizer, opt_shardings
from multipod.pod_worker.schema import WorkerConfig
from multipod.pod_worker.trainer import PodTrainer, fingerprint


@dataclasses.dataclass(frozen=True)
class MaskedBatch:
    """A batch on the pod's devices with the targets its loss counts."""
    tokens: jax.Array       # int32 [rows, T+1]
    loss_mask: jax.Array    # uint8 [rows, T]
    count: int | None       # targets counted (the mask's sum); None: not known on this host alone

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tokens.shape)


def base_step_folder(path: str) -> pathlib.Path:
    """The base checkpoint's step folder: `path` itself, or the newest under a checkpoint directory."""
    folder = pathlib.Path(path).expanduser().absolute()
    return folder if folder.name.isdigit() else checkpoint.latest(str(folder))


def check_base_model(path: pathlib.Path, base: ModelConfig, model: ModelConfig) -> None:
    """ConfigError naming the first model value the base checkpoint disagrees on (layout fields aside)."""
    for f in dataclasses.fields(ModelConfig):
        if f.name not in LAYOUT_FIELDS and getattr(base, f.name) != getattr(model, f.name):
            raise ConfigError(f"model.{f.name}", f"the base checkpoint {path} has {getattr(base, f.name)!r}, this "
                              f"run has {getattr(model, f.name)!r}: a prompt is tuned on the base model as trained")


def load_base(path: str, model: ModelConfig, shardings, scalar_sharding) -> tuple[dict, str]:
    """The base checkpoint's parameters on the devices (laid out by `shardings`) and their
    fingerprint. The whole saved state is read (its optimizer state laid out over the same
    mesh, which can hold it whatever mesh saved it) and
    checked against the fingerprint saved with it (a corrupt base is refused), then the
    optimizer state is dropped."""
    folder = base_step_folder(path)
    metadata = checkpoint.read_metadata(str(folder))
    try:
        saved = WorkerConfig.from_json(json.dumps(metadata.get("worker_config")))
    except ConfigError as exc:
        raise checkpoint.CheckpointError(f"base checkpoint {folder}: its worker config is unreadable: {exc}") from None
    check_base_model(folder, saved.model, model)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          jax.eval_shape(lambda: _unboxed(model)), shardings)
    opt = jax.eval_shape(make_optimizer(saved.optimizer, saved.schedule_steps).init, params)
    opt_layout = opt_shardings(opt, shardings, scalar_sharding)
    opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt, opt_layout)
    template = {"params": params, "opt_state": opt, "step": 0}
    if "outer" in metadata:     # a DiLoCo pod's part: its own parameters, and the agreed ones in "outer"
        template["outer"] = outer_restore_template(saved.sync, params, shardings, scalar_sharding,
                                                   saved.model.n_layers, metadata["outer"])
    state, meta = checkpoint.restore(str(folder), template)
    if fingerprint(state["params"], state["opt_state"], state.get("outer", {})) != meta.get("fingerprint"):
        raise checkpoint.CheckpointError(f"base checkpoint {folder} is corrupt: its state does not match the "
                                         f"fingerprint saved with it")
    # DiLoCo: the base is the agreed parameters (what the run evaluated and sampled, the same in
    # every pod's part), not this pod's own, which differ from the others' between outer steps.
    base = state["params"] if "outer" not in state else \
        jax.tree.unflatten(jax.tree.structure(params), state["outer"]["agreed"])
    return base, fingerprint(base)


def _unboxed(model: ModelConfig):
    import flax.linen as nn
    return nn.unbox(abstract_params(model))


class PromptTrainer(PodTrainer):
    """PodTrainer for prompt.kind: trains the prompt parameters on the frozen base (see the module)."""

    defers_initial_state = False    # the base it loads and the seeded prompt are where it starts

    def _initial_params(self):
        """Load the base, then the prompt parameters from the seed (replicated: they are small)."""
        model, prompt = self.config.model, self.config.prompt
        self.base_sharding = param_shardings(abstract_params(model), self.mesh)
        self.base, self.base_fingerprint = load_base(prompt.base_checkpoint, model, self.base_sharding,
                                                     self.scalar_sharding)
        seed = self.config.train.seed
        params = init_prompt_params(prompt.kind, prompt.virtual_tokens, model.d_model, prompt.hidden, seed)
        if prompt.kind == "prompt":
            # From this host's copy of the embedding (on several hosts the base spans them all).
            embedding = host_value(self.base["embedding"])
            params = {**params, "virtual": sampled_vocab_init(embedding, prompt.virtual_tokens, seed)}
        sharding = jax.tree.map(lambda _: self.scalar_sharding, params)
        # Host copies, the same on every host, go onto the pod's devices replicated.
        return sharding, jax.device_put(jax.tree.map(np.asarray, params), sharding)

    def _compile(self) -> None:
        super()._compile()      # the update, checksum and widening programs are the same
        self._base_checksum = programs.checksum_program(self.base_sharding, out_sharding=self.scalar_sharding)
        self.base_checksum_loaded = self.base_checksum()
        model, prompt = self.config.model, self.config.prompt
        p, base, b, s = self.param_sharding, self.base_sharding, self.batch_sharding, self.scalar_sharding
        grad_step = programs.make_prompt_grad_step(model, prompt.kind, prompt.hidden)
        eval_step = programs.make_prompt_eval_step(model, prompt.kind, prompt.hidden)
        with activate_rules(self.mesh):
            self._grad_step = jax.jit(grad_step, in_shardings=(p, base, b, b, s), out_shardings=(p, s, s))
            self._eval_step = jax.jit(eval_step, in_shardings=(p, base, b, b), out_shardings=(s, s))
            embed = functools.partial(prompt_embeddings, kind=prompt.kind, d_model=model.d_model,
                                      hidden=prompt.hidden)
            self._prefix = jax.jit(embed, in_shardings=(p,), out_shardings=s)
            self._mask_count = jax.jit(lambda m: jnp.sum(m, dtype=jnp.int32), in_shardings=(b,), out_shardings=s)

    def abstract_batch(self, tokens: jax.ShapeDtypeStruct) -> MaskedBatch:
        rows, cols = tokens.shape
        return MaskedBatch(tokens, jax.ShapeDtypeStruct((rows, cols - 1), np.uint8, sharding=self.batch_sharding), 0)

    def _grad_inputs(self, batch: MaskedBatch, norm, params=None) -> tuple:
        return self.params if params is None else params, self.base, batch.tokens, batch.loss_mask, norm

    def put_batch(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None) -> MaskedBatch:
        """Tokens and their loss mask (None: every target counts) onto the devices (with several
        hosts: this host's rows of the pod's batch, whose count of targets target_count sums)."""
        if loss_mask is None:
            loss_mask = np.ones((tokens.shape[0], tokens.shape[1] - 1), np.uint8)
        loss_mask = np.asarray(loss_mask, np.uint8)
        on_device = super().put_batch(tokens)
        if self.layout.multi:
            global_shape = (loss_mask.shape[0] * self.layout.hosts_per_pod, loss_mask.shape[1])
            mask = jax.make_array_from_process_local_data(self.batch_sharding, loss_mask, global_shape)
            return MaskedBatch(on_device, mask, None)
        mask = jax.device_put(loss_mask, self.batch_sharding)
        return MaskedBatch(on_device, mask, int(np.count_nonzero(loss_mask)))

    def target_count(self, batch: MaskedBatch) -> int:
        """The pod's count of targets in the batch. With several hosts it is summed on the devices:
        a program every host runs, called inside the step where they all run the same ones."""
        if batch.count is None:
            return int(host_value(self._mask_count(batch.loss_mask)))
        return batch.count

    def warm_up(self, batch_shape: tuple[int, int], evaluate: bool = True) -> None:
        """Nothing: prompt tuning runs the fused step, compiled ahead, and its evaluation takes the
        task's loss mask, which a shard of zeros does not have."""

    def evaluate(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None) -> tuple[float, int]:
        if self.layout.multi:
            # Every host of the pod is given the whole batch: each puts the rows of its devices.
            if loss_mask is None:
                loss_mask = np.ones((tokens.shape[0], tokens.shape[1] - 1), np.uint8)
            loss_mask = np.asarray(loss_mask, np.uint8)
            on_device = jax.make_array_from_callback(tokens.shape, self.batch_sharding, lambda index: tokens[index])
            on_device = on_device if on_device.dtype == jnp.int32 else self._widen(on_device)
            mask = jax.make_array_from_callback(loss_mask.shape, self.batch_sharding, lambda index: loss_mask[index])
            batch = MaskedBatch(on_device, mask, int(np.count_nonzero(loss_mask)))
        else:
            batch = self.put_batch(tokens, loss_mask)
        with activate_rules(self.mesh):
            ce, z = self._eval_step(self.params, self.base, batch.tokens, batch.loss_mask)
        return float(ce), batch.count

    @functools.cached_property
    def generator(self) -> Generator:
        """Generation after the learned virtual tokens (they take the first context positions)."""
        return Generator(self.config.model, self.mesh, self.base_sharding, prefix_len=self.config.prompt.virtual_tokens)

    def params_copy(self):
        """(the base, the virtual-token embeddings of the current prompt): what the generator takes.
        The base is never donated; the embeddings are a new array."""
        with activate_rules(self.mesh):
            return self.base, self._prefix(self.params)

    def base_checksum(self) -> str:
        """programs.state_checksum of the base, computed on the devices."""
        return programs.checksum_hex(host_value(self._base_checksum(self.base)))

    def save_metadata(self) -> dict:
        # The base's checksum again at every save, beside the one taken at load: each prompt
        # checkpoint shows the base as it was then.
        return {"base_fingerprint": self.base_fingerprint, "base_checksum": self.base_checksum(),
                "base_checksum_loaded": self.base_checksum_loaded,
                "base_checkpoint": str(self.config.prompt.base_checkpoint)}

    def check_restorable(self, path: str, metadata: dict) -> None:
        saved = metadata.get("base_fingerprint")
        if saved != self.base_fingerprint:
            raise checkpoint.CheckpointError(
                f"prompt checkpoint {path} was tuned on a base model with fingerprint {saved or 'unknown'} "
                f"({metadata.get('base_checkpoint', '?')}); this pod's base {self.config.prompt.base_checkpoint} has "
                f"fingerprint {self.base_fingerprint}: give the base the prompt was tuned on")
