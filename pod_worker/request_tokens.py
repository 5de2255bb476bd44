"""Token ids and loss masks as requests carry them (Step, Evaluate, AdoptSlot, Generate): decoded
from the codec and checked against the pod's config, or refused with INVALID_ARGUMENT."""
from __future__ import annotations

import numpy as np

from multipod import protos
from multipod.pod_worker.pod import Setup
from multipod.pod_worker.rpc_handler import invalid
from multipod.protos import codec

# Token ids travel as the narrowest of these that holds the vocabulary; the devices widen them.
TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


def decode_tokens(setup: Setup, payload: bytes, rows: int | None) -> np.ndarray:
    """A codec-encoded [rows, seq_len + 1] batch of uint8, uint16 or int32 token ids, checked
    against the pod's config (kept in its dtype: the devices widen it)."""
    config = setup.config
    tokens = codec.decode(payload, max_bytes=protos.MAX_MESSAGE_BYTES)
    if tokens.dtype not in TOKEN_DTYPES or tokens.ndim != 2:
        raise invalid(f"tokens must be a 2-d uint8, uint16 or int32 array, got {tokens.ndim}-d {tokens.dtype}")
    want_cols = config.train.seq_len + 1
    if tokens.shape[1] != want_cols or (rows is not None and tokens.shape[0] != rows):
        raise invalid(f"tokens shape {tokens.shape} != expected ({rows if rows is not None else 'B'}, {want_cols})")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.model.vocab_size):
        raise invalid(f"token ids must be in [0, {config.model.vocab_size})")
    return tokens


def decode_mask(setup: Setup, payload: bytes, tokens: np.ndarray) -> np.ndarray | None:
    """A codec-encoded uint8 loss mask of 0s and 1s, one per target of `tokens` ([rows, seq_len]);
    None if empty (every target counts). Taken only by a prompt-tuning pod."""
    if not payload:
        return None
    if not setup.config.prompt.enabled:
        raise invalid("loss_mask is taken only by a pod tuning a prompt (prompt.kind); this pod trains the whole "
                       "model on every target")
    mask = codec.decode(payload, max_bytes=protos.MAX_MESSAGE_BYTES)
    want = (tokens.shape[0], tokens.shape[1] - 1)
    if mask.dtype != np.uint8 or mask.shape != want:
        raise invalid(f"loss_mask must be uint8 {want} (one per target), got {mask.dtype} {mask.shape}")
    if mask.size and mask.max() > 1:
        raise invalid("loss_mask values must be 0 or 1")
    return mask
