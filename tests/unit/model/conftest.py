"""Shared fixtures for the model tests: a tiny config and its params (built once)."""
import pytest

from multipod.model import ModelConfig, init_params


@pytest.fixture(scope="session")
def tiny_config():
    return ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8,
                       mlp_dim=64, max_seq_len=16)


@pytest.fixture(scope="session")
def tiny_params(tiny_config):
    return init_params(tiny_config, seed=0)
