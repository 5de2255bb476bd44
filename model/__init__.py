"""PaLM-style decoder-only language model (Flax linen), mesh-agnostic.

Sharding lives in `model.partitioning`; the model itself only names logical axes.
"""
from model.config import ConfigError, ModelConfig
from model.generate import generate
from model.loss import loss_sums, token_losses
from model.transformer import Transformer, abstract_params, init_params

__all__ = [
    "ConfigError",
    "ModelConfig",
    "Transformer",
    "abstract_params",
    "generate",
    "init_params",
    "loss_sums",
    "token_losses",
]
