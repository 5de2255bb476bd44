"""What the step loop needs from the data, whatever its source: the DataError every data module
raises, the wire dtype of token ids (token_dtype, narrow), cutting a global batch into per-pod
shards, and the Prefetcher that builds the next steps' shards ahead on a thread.

The data itself comes from elsewhere, one job per module: sources.py reads documents,
token_cache.py tokenizes them once into memory-mapped shards, dataset.py packs them into sequences
and orders them by a permutation per epoch (a pure function of (seed, step), so resume is exact).
"""
from __future__ import annotations

import dataclasses
import queue
import threading

import numpy as np

from multipod.controller.core.errors import RunError
from multipod.protos import codec


class DataError(ValueError):
    """The data cannot be used (missing, malformed, empty, too small); the message names the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest integer dtype that holds every id of the vocabulary and that the wire codec
    carries: uint8 up to 256 ids, uint16 up to 65536, int32 beyond. Batches travel in it and the
    worker widens them on its devices."""
    for dtype, limit in ((np.uint8, 1 << 8), (np.uint16, 1 << 16)):
        if vocab_size <= limit and np.dtype(dtype).name in codec.DTYPES:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def narrow(tokens: np.ndarray, dtype=None) -> np.ndarray:
    """`tokens` as `dtype` (default: the narrowest that holds their values) for the wire."""
    if dtype is None:
        dtype = token_dtype(int(tokens.max()) + 1 if tokens.size else 1)
    dtype = np.dtype(dtype)
    if tokens.size and dtype != tokens.dtype and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DataError(f"token ids in [{tokens.min()}, {tokens.max()}] do not fit {dtype}")
    return tokens.astype(dtype, copy=False)


def shard(batch: np.ndarray, num_pods: int) -> list[np.ndarray]:
    """Cut a global batch into one contiguous shard per pod."""
    if batch.shape[0] % num_pods:
        raise DataError(f"global batch of {batch.shape[0]} does not split over {num_pods} pods")
    return np.split(batch, num_pods)


@dataclasses.dataclass(frozen=True)
class StepData:
    """One step's encoded per-pod shards: tokens, loss masks (b"" where every target counts),
    and the loss normaliser: the targets counted in the whole global batch."""
    tokens: list[bytes]
    masks: list[bytes]
    global_tokens: int


def step_data(tokens: np.ndarray, mask: np.ndarray | None, num_pods: int, dtype) -> StepData:
    """A global batch (and its loss mask, None: every target counts) cut and encoded per pod."""
    shards = [codec.encode(narrow(s, dtype)) for s in shard(tokens, num_pods)]
    if mask is None:
        return StepData(shards, [b""] * num_pods, int(tokens.shape[0] * (tokens.shape[1] - 1)))
    masks = [codec.encode(np.ascontiguousarray(m, np.uint8)) for m in shard(mask, num_pods)]
    return StepData(shards, masks, int(np.count_nonzero(mask)))


class Prefetcher:
    """Builds the encoded per-pod shards of steps start..stop-1 on a background thread, `depth`
    steps ahead, so the step loop never waits for data. Step s trains on batch s + offset (the
    offset grows when a loss-spike rewind skips batches). `batches` is anything with batch(i) and
    loss_mask(i) (None: every target counts). Shards are encoded as `dtype` (data.token_dtype of
    the vocabulary: uint8 for bytes)."""

    def __init__(self, batches, num_pods: int, start: int, stop: int, depth: int = 4, offset: int = 0,
                 dtype=np.int32):
        self._dtype = np.dtype(dtype)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, num_pods, start, stop, offset),
                                        daemon=True, name="prefetch")
        self._thread.start()

    def _run(self, batches, num_pods: int, start: int, stop: int, offset: int) -> None:
        for step in range(start, stop):
            try:
                index = step + offset
                item = (step, step_data(batches.batch(index), batches.loss_mask(index), num_pods, self._dtype))
            except Exception as exc:   # handed to the loop, which raises it: not a silent stall
                item = (step, exc)
            # Short waits on a full queue, so that close() is noticed soon.
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item[1], Exception):
                return

    def next(self, timeout_s: float = 60.0) -> tuple[int, StepData]:
        """(step, its StepData) of the next step; RunError if none comes within timeout_s."""
        try:
            step, shards = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise RunError(f"the data pipeline produced no batch within {timeout_s:g}s") from None
        if isinstance(shards, Exception):
            raise shards
        return step, shards

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, join_s: float = 1.0) -> None:
        """Stop the producer thread (waiting up to join_s for it to end)."""
        self._stop.set()
        self._thread.join(timeout=join_s)
