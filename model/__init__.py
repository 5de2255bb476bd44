"""PaLM-style decoder-only language model (Flax linen), mesh-agnostic.

Sharding lives in `model.partitioning`; the model itself only names logical axes.
"""
from multipod.model.config import ConfigError, ModelConfig

# The rest on first use (PEP 562): reading a config (the controller does, for every command) must
# not import jax and flax, about a second and a half of every command's start.
_LAZY = {"Chunk": "decode", "Decoder": "decode", "Sampling": "decode", "loss_sums": "loss",
         "token_losses": "loss", "generate": "sampling", "Transformer": "transformer",
         "abstract_params": "transformer", "init_params": "transformer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"multipod.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Chunk",
    "ConfigError",
    "Decoder",
    "Sampling",
    "ModelConfig",
    "Transformer",
    "abstract_params",
    "generate",
    "init_params",
    "loss_sums",
    "token_losses",
]
