"""A PodTrainer's state in and out, a mixin of PodTrainer (trainer.py): its construction (the
initial state, or only its layout for a pod that awaits a restore), what it hashes to (the
per-step on-device checksum; the fingerprint, BLAKE2b of a host copy), copies of it (on the host
for checkpoints, sampling and a peer's rejoin; on the devices for generation), its replacement
after a restore, and the checkpoint hooks a PromptTrainer overrides."""
from __future__ import annotations

import hashlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from multipod.model import abstract_params, init_params
from multipod.model.partitioning import param_shardings
from multipod.pod_worker import programs
from multipod.pod_worker.errors import NotReady
from multipod.pod_worker.hosts import host_value
from multipod.pod_worker.optimizer import opt_shardings


class NoState(NotReady):
    """The trainer holds no state yet (PodTrainer(initial_state=False), before its first restore)."""

# One program for the whole tree (jnp.copy leaf by leaf compiles one per leaf shape). Its outputs
# are new buffers laid out as its inputs: XLA never returns a parameter that was not donated.
_copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def fingerprint(*trees) -> str:
    """A hash of the bytes of every leaf, in tree order: equal iff the states are bitwise equal."""
    digest = hashlib.blake2b(digest_size=16)
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            digest.update(memoryview(np.ascontiguousarray(host_value(leaf)).reshape(-1).view(np.uint8)))
    return digest.hexdigest()


def abstract_tree(tree, shardings):
    """ShapeDtypeStructs of a tree of arrays (or of ShapeDtypeStructs), laid out by `shardings`."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


class TrainerState:
    """The state I/O of PodTrainer: it works on PodTrainer's params, opt_state, step, shardings and
    (DiLoCo) outer state."""

    # Whether a trainer of this class can start without a state (initial_state=False): a
    # PromptTrainer's frozen base and seeded prompt are its starting point, so it cannot.
    defers_initial_state = True

    def _build_state(self, initial_state: bool):
        """The state's shardings, and the initial state itself, or with initial_state=False only
        its layout (state_abstract; params and opt_state None until load_state). Returns the
        parameters' tree (arrays, or their ShapeDtypeStructs)."""
        self.param_sharding, self.params = self._initial_params() if initial_state else \
            (self._param_layout(), None)
        params_abstract = self.params if self.params is not None else \
            abstract_tree(nn.unbox(abstract_params(self.config.model)), self.param_sharding)
        opt_abstract = jax.eval_shape(self.tx.init, params_abstract)
        # Optimizer leaves shaped like a parameter take its sharding; scalars (e.g. AdamW's count)
        # need an explicit replicated sharding or jit's in_shardings refuses them.
        self.opt_sharding = opt_shardings(opt_abstract, self.param_sharding, self.scalar_sharding)
        self.opt_state = None if self.params is None else \
            jax.jit(self.tx.init, out_shardings=self.opt_sharding)(self.params)
        # The state's shapes, dtypes and shardings, whether it is held yet or not (a restore's target).
        self.state_abstract = {"params": abstract_tree(params_abstract, self.param_sharding),
                               "opt_state": abstract_tree(opt_abstract, self.opt_sharding)}
        return params_abstract

    def _param_layout(self):
        """The shardings of what this pod trains: the whole model, laid out by the rules table."""
        return param_shardings(abstract_params(self.config.model), self.mesh)

    def _initial_params(self):
        """(shardings, parameters) of what this pod trains. Identical on every pod: a pure function
        of the seed, computed locally, never transferred."""
        sharding = self._param_layout()
        # Outside activate_rules, as abstract_params traced the init: jax then reuses that trace
        # (a trace is cached per mesh context). jit's out_shardings lays the parameters out.
        params = init_params(self.config.model, self.config.train.seed, shardings=sharding)
        return sharding, params

    @property
    def has_state(self) -> bool:
        """Whether the trainer holds its parameters and optimizer state (PodTrainer(initial_state=
        False): not until a restore)."""
        return self.params is not None

    def require_state(self, what: str) -> None:
        """NoState if there is no state to `what` yet."""
        if self.params is None:
            raise NoState(f"no state to {what} yet: this pod was configured to await its state, which its first "
                          f"Restore gives it")

    def save_metadata(self) -> dict:
        """What a checkpoint of this trainer records beside its state (PromptTrainer: its base)."""
        return {}

    def check_restorable(self, path: str, metadata: dict) -> None:
        """CheckpointError-raising hook: a checkpoint that fits the state's shapes but not this
        trainer (PromptTrainer: made for another base model)."""

    def fingerprint(self) -> str:
        """The fingerprint: BLAKE2b of a host copy of every parameter and optimizer-state leaf (at
        checkpoints, transfers, and every run.fingerprint_every steps); in DiLoCo mode, of the
        agreed state (the agreed parameters and the outer optimizer's), which every pod shares."""
        if self.outer is not None:
            return fingerprint(*self.outer.agreed_state())
        self.require_state("hash")
        return fingerprint(self.params, self.opt_state)

    def checksum(self) -> str:
        """The state checksum (every step): programs.state_checksum of the state, computed on the devices;
        only its 8 bytes come to the host. In DiLoCo mode, of the agreed state (as fingerprint)."""
        if self.outer is not None:     # it changes only with an outer step: computed once per version
            cached = getattr(self, "_outer_checksum_of", None)
            if cached is None or cached[0] != self.outer.version:
                value = programs.checksum_hex(host_value(self._outer_checksum(*self.outer.agreed_state())))
                self._outer_checksum_of = cached = (self.outer.version, value)
            return cached[1]
        self.require_state("check")
        program = getattr(self, "_checksum_compiled", None) or self._checksum
        return programs.checksum_hex(host_value(program(self.params, self.opt_state)))

    def params_copy(self) -> dict:
        """A copy of the parameters on the devices, in their training layout, for generation: the
        next update donates the live buffers. Take it between steps (a sequencer hold). In DiLoCo
        mode, of the agreed parameters."""
        self.require_state("generate from")
        return _copy_tree(self.agreed_params)

    def host_state(self, replica: int | None = None) -> dict:
        """Parameters, optimizer state and step as host arrays (for checkpoints, sampling and a
        peer's rejoin); in DiLoCo mode also the outer state ("outer": outer_arrays), and with
        `replica`, the inner state of that slot's replica if this pod hosts one."""
        self.require_state("copy")
        own = self.outer.replicas.get(replica) if self.outer is not None and replica is not None else None
        params, opt_state = (own.params, own.opt_state) if own is not None else (self.params, self.opt_state)
        state = {"params": jax.tree.map(host_value, params),
                 "opt_state": jax.tree.map(host_value, opt_state),
                 "step": self.step}
        if self.outer is not None:
            state["outer"] = jax.tree.map(host_value, self.outer_arrays())
        return state

    def load_state(self, params, opt_state, step: int) -> None:
        """Replace the state (after a restore; or give the trainer its first); shapes are checked
        against the model's."""
        expected = jax.tree.structure(self.state_abstract["params"])
        if jax.tree.structure(params) != expected:
            raise ValueError("checkpoint parameters have a different structure than this model")
        for have, want in zip(jax.tree.leaves(params), jax.tree.leaves(self.state_abstract["params"])):
            if tuple(have.shape) != tuple(want.shape) or np.dtype(have.dtype) != np.dtype(want.dtype):
                raise ValueError(f"checkpoint parameter {have.shape}/{have.dtype} != model's {want.shape}/{want.dtype}")
        self.params = jax.device_put(params, self.param_sharding)
        self.opt_state = jax.device_put(opt_state, self.opt_sharding)
        self.step = int(step)
        self._count = None      # read from the restored optimizer state at the next update
