"""Packed sequences from a token cache, in a fresh permutation every epoch: the batches of a run.

The documents of a split are already EOS-terminated and concatenated (token_cache.py), so packing
is arithmetic: sequence i is stream[i * seq_len : i * seq_len + seq_len + 1] (the inputs and the
targets share the boundary token), and a split of n tokens holds (n - 1) // seq_len sequences.

Training order: global row g = step * global_batch + r lies in epoch g // N at position g % N (N =
the train sequences), and is sequence permutation(seed, epoch)[position], the permutation being
np.random.default_rng([seed, epoch]).permutation(N). Each epoch visits every sequence exactly once,
a batch may span two epochs, and the batch of a step is a pure function of (seed, step): asked in
any order, on any instance, before or after a resume, it is the same. Eval reads the held-out
sequences in order, unshuffled.

Memory: a permutation is N int64s (800 MB at 10^8 sequences, fine below that); the last two
epochs' are kept. Why plain numpy memmaps and not Grain's MapDataset: random access into one packed,
fixed-size stream is a few lines here, it adds no dependency, and resume is exact by construction
because the order is a pure function of (seed, step), with no iterator state to checkpoint.
"""
from __future__ import annotations

import threading

import numpy as np

from multipod.controller.data.batches import DataError

# Permutations kept: the current epoch's, and the previous one's for a batch that spans the boundary.
KEEP_EPOCHS = 2


class TokenDataset:
    """Train and eval batches of int32 tokens [global_batch, seq_len + 1] from a TokenCache.

    DataError (naming the split and its size) if the train split has fewer sequences than
    global_batch or the eval split has none."""

    def __init__(self, cache, seq_len: int, global_batch: int, seed: int):
        self.cache, self.seq_len, self.global_batch, self.seed = cache, seq_len, global_batch, seed
        self.num_train_sequences = max(0, (len(cache.train) - 1) // seq_len)
        self.num_eval_sequences = max(0, (len(cache.eval) - 1) // seq_len)
        if self.num_train_sequences < global_batch:
            raise DataError(f"the train split of token cache {cache.directory} has {len(cache.train):,} tokens: "
                            f"{self.num_train_sequences:,} sequences of seq_len {seq_len}, fewer than the global "
                            f"batch of {global_batch}; use more data or a smaller seq_len or batch")
        if self.num_eval_sequences == 0:
            raise DataError(f"the eval split of token cache {cache.directory} has {len(cache.eval):,} tokens: "
                            f"no sequence of seq_len {seq_len} (needs {seq_len + 1} tokens); use more data "
                            "or a smaller seq_len")
        # Eval rows wrap around the held-out sequences when there are fewer than a batch.
        self.num_eval_batches = max(1, self.num_eval_sequences // global_batch)
        self.eval_bytes_per_token = cache.text_bytes["eval"] / len(cache.eval)
        self._permutations: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()    # the prefetch thread and the step loop may both ask

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the train sequences in `epoch`: a function of (seed, epoch) only."""
        with self._lock:
            order = self._permutations.get(epoch)
            if order is None:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_train_sequences)
                self._permutations[epoch] = order
                for old in sorted(self._permutations)[:-KEEP_EPOCHS]:
                    del self._permutations[old]
            return order

    def _rows(self, stream, sequences) -> np.ndarray:
        batch = np.empty((len(sequences), self.seq_len + 1), np.int32)
        for row, sequence in enumerate(sequences):
            batch[row] = stream.read(int(sequence) * self.seq_len, self.seq_len + 1)
        return batch

    def batch(self, step: int) -> np.ndarray:
        """The training batch of `step`: int32 [global_batch, seq_len + 1], a function of (seed, step)."""
        rows = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, positions = np.divmod(rows, self.num_train_sequences)
        sequences = np.empty_like(rows)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            sequences[chosen] = self.permutation(int(epoch))[positions[chosen]]
        return self._rows(self.cache.train, sequences)

    def loss_mask(self, step: int) -> None:
        """Every target of a corpus batch counts (a task's batches carry a mask: task_data.py)."""
        return None

    def eval_loss_mask(self, index: int) -> None:
        return None

    def epoch(self, step: int) -> float:
        """Epochs completed once `step` is done (1.5: one full pass and half the next)."""
        return (step + 1) * self.global_batch / self.num_train_sequences

    def eval_batch(self, index: int) -> np.ndarray:
        """Held-out batch `index`: the eval sequences in order, rows index * global_batch + r,
        wrapping around the eval split."""
        rows = index * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        return self._rows(self.cache.eval, rows % self.num_eval_sequences)
