"""Model hyperparameters, their validation, and derived size/FLOP figures."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

# Names accepted for `dtype` / `param_dtype`: jnp's own names for them. Names, not jnp dtypes, so
# that reading a config (the controller does) does not import jax.
DTYPES = ("bfloat16", "float32")


class PromptKind(enum.StrEnum):
    """What is trained (prompt.kind): the virtual tokens themselves, or an encoder making them."""
    PROMPT = "prompt"
    MLP = "mlp"
    LSTM = "lstm"


class RematPolicy(enum.StrEnum):
    """Activation recomputation (model.remat; see model.layers.remat_policy):
      none      keep every activation the backward pass needs;
      full      keep only each block's input and recompute the whole block in the backward pass;
      selective keep the matmul outputs, recompute the cheap memory-heavy parts (attention scores,
                softmax, norms, RoPE, elementwise ops)."""
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class ConfigError(ValueError):
    """A bad config value; str() names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


Choice = TypeVar("Choice", bound=enum.Enum)


def to_enum(name: str, choices: type[Choice], value) -> Choice:
    """`value` (a member or its string) as a member of the enum `choices`; ConfigError(name)
    listing the choices if it is neither. Every config field with a fixed set of values loads
    through this."""
    try:
        return choices(value)
    except ValueError:
        raise ConfigError(name, f"must be one of {', '.join(str(c.value) for c in choices)}, got {value!r}") from None


# ModelConfig fields that only lay the math out (where and when it runs, not what it computes): a
# trained model may be run, tuned or resumed with other values than it was trained with.
LAYOUT_FIELDS = ("remat", "sequence_parallel", "microbatches")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the PaLM-style decoder-only Transformer.

    Frozen (hence hashable) so it can key compile caches, e.g. in `generate`.
    """

    # The defaults are the default run's model (docs/default_run.md: sized by measurement so
    # that `multipod local` writes Python-looking samples in about 3 minutes on 2 CPU cores).
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 1  # 1 = multi-query attention
    head_dim: int = 32
    mlp_dim: int = 512  # SwiGLU hidden width
    max_seq_len: int = 128
    rope_base: float = 10000.0
    z_loss_weight: float = 1e-4
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
    param_dtype: str = "float32"
    # Within-pod techniques. They change where and when the math runs, not the math: loss and
    # gradients agree with the plain layout to float tolerance.
    sequence_parallel: bool = False  # shard norm/residual activations along the sequence over `model`
    remat: RematPolicy = RematPolicy.NONE
    microbatches: int = 1  # gradient accumulation: a pod's shard is split into this many pieces

    def __post_init__(self):
        # A plain string (TOML, JSON, a caller's "full") is held as the member.
        object.__setattr__(self, "remat", to_enum("model.remat", RematPolicy, self.remat))

    def validate(self) -> None:
        """Raise ConfigError("model.<field>", ...) for the first bad value found."""
        positive_ints = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                         "head_dim", "mlp_dim", "max_seq_len", "microbatches")
        for name in positive_ints:
            value = getattr(self, name)
            # bool is an int subclass; a True here is almost certainly a mistake.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"model.{name}", f"must be an int, got {value!r}")
            if value <= 0:
                raise ConfigError(f"model.{name}", f"must be positive, got {value}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("model.n_kv_heads",
                              f"{self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            # RoPE rotates pairs of features.
            raise ConfigError("model.head_dim", f"must be even for RoPE, got {self.head_dim}")
        for name, lower_ok in (("rope_base", False), ("init_std", False), ("z_loss_weight", True)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"model.{name}", f"must be a number, got {value!r}")
            if value < 0 or (value == 0 and not lower_ok):
                bound = "non-negative" if lower_ok else "positive"
                raise ConfigError(f"model.{name}", f"must be {bound}, got {value}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in DTYPES:
                raise ConfigError(f"model.{name}",
                                  f"must be one of {sorted(DTYPES)}, got {value!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError("model.sequence_parallel",
                              f"must be true or false, got {self.sequence_parallel!r}")

    @property
    def compute_dtype(self):
        """The jnp dtype for activations."""
        import jax.numpy as jnp
        return getattr(jnp, self.dtype)

    @property
    def weight_dtype(self):
        """The jnp dtype parameters are stored in."""
        import jax.numpy as jnp
        return getattr(jnp, self.param_dtype)

    def param_count(self) -> int:
        """Exact number of parameters the Flax model creates."""
        d, q = self.d_model, self.head_dim
        attn = d * self.n_heads * q  # query
        attn += 2 * d * self.n_kv_heads * q  # key and value
        attn += self.n_heads * q * d  # output projection
        mlp = 3 * d * self.mlp_dim  # gate, up, down
        block = d + attn + mlp  # one shared pre-norm scale per block
        return self.vocab_size * d + self.n_layers * block + d  # + final norm scale

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM appendix B: 6*N + 12*L*H*Q*T.

        N counts every parameter, the shared embedding included, because the output
        projection multiplies by it.
        """
        n = self.param_count()
        return float(6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len)
