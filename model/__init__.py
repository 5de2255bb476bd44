"""PaLM-style decoder-only language model (Flax linen), mesh-agnostic.

Sharding lives in `model.partitioning`; the model itself only names logical axes.
"""
from multipod.model.config import ConfigError, ModelConfig
from multipod.model.decode import Chunk, Decoder, Sampling
from multipod.model.loss import loss_sums, token_losses
from multipod.model.sampling import generate
from multipod.model.transformer import Transformer, abstract_params, init_params

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
