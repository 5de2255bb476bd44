"""A prompt-tuning task: a .jsonl of examples, each an input and the output the model should write
after it (data.input_field, data.output_field), as batches of tokens with a loss mask.

Example e is tokens = encode(input) + encode(output) + [EOS], right-padded with EOS to
seq_len + 1; the loss counts the targets that are output tokens (the EOS after the output too, so
the model learns to stop), never the input or the padding. Every 10th example (the 10th, 20th,
...) is held out for evaluation when the file has at least 20; the rest are trained on in a fresh
permutation every epoch from (seed, epoch), so, as for the corpus (dataset.py), the batch of a
step is a pure function of (seed, step) and a resumed run sees exactly the batches it would have.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from multipod.controller.data.batches import DataError
from multipod.controller.data.sources import jsonl_records, record_text

HOLD_OUT_EVERY = 10
MIN_FOR_HOLD_OUT = 20


@dataclasses.dataclass(frozen=True)
class Example:
    input: str
    output: str
    ids: list[int]          # input + output + EOS
    input_len: int          # tokens of the input
    where: str              # FILE:LINE, for errors


def read_examples(path: str, tokenizer, input_field: str, output_field: str) -> list[Example]:
    """Every example of the task file, tokenized; DataError naming the file and line of a record
    without a string input or output or with an empty output, or naming an empty file."""
    file = pathlib.Path(path)
    # Named here, not in jsonl_records: in a corpus folder an unreadable file is left out and reported.
    if not file.exists():
        raise DataError(f"{file}: no such file")
    if file.is_dir():
        raise DataError(f"{file}: a folder, not a .jsonl file of examples")
    examples = []
    try:
        records = list(jsonl_records(file, what="example"))
    except OSError as exc:
        raise DataError(f"{file}: cannot be read: {exc.strerror or exc}") from None
    for where, record in records:
        source = record_text(where, record, input_field, "name another with data.input_field")
        target = record_text(where, record, output_field, "name another with data.output_field")
        if not target:
            raise DataError(f"{where}: the output is empty: there is nothing to learn from this example")
        head = tokenizer.encode(source).tolist()
        ids = head + tokenizer.encode(target).tolist() + [tokenizer.eos_id]
        examples.append(Example(source, target, ids, len(head), where))
    return examples


def needed_seq_len(examples: list[Example]) -> int:
    """The seq_len that fits the longest example (its tokens minus one: inputs and targets overlap)."""
    return max(len(e.ids) for e in examples) - 1


class TaskDataset:
    """Train and eval batches of a task: tokens int32 [global_batch, seq_len + 1] and loss_mask
    uint8 [global_batch, seq_len] (see the module). DataError naming the example that does not
    fit seq_len."""

    def __init__(self, examples: list[Example], seq_len: int, global_batch: int, seed: int, eos_id: int,
                 text_bytes_of=lambda text: len(text.encode())):
        self.seq_len, self.global_batch, self.seed, self.eos_id = seq_len, global_batch, seed, eos_id
        for example in examples:
            if len(example.ids) > seq_len + 1:
                raise DataError(f"{example.where}: input + output + end-of-text are {len(example.ids)} tokens; at "
                                f"most {seq_len + 1} fit (data.seq_len {seq_len}, after prompt.virtual_tokens in "
                                f"model.max_seq_len)")
        held = len(examples) >= MIN_FOR_HOLD_OUT
        is_eval = [held and (i + 1) % HOLD_OUT_EVERY == 0 for i in range(len(examples))]
        self.train = [e for e, ev in zip(examples, is_eval) if not ev]
        self.eval = [e for e, ev in zip(examples, is_eval) if ev]
        self._train_tokens, self._train_mask = self._pack(self.train)
        self._eval_tokens, self._eval_mask = self._pack(self.eval)
        self.num_eval_batches = -(-len(self.eval) // global_batch) if self.eval else 0
        outputs = sum(len(e.ids) - e.input_len for e in self.eval)
        self.eval_bytes_per_token = (sum(text_bytes_of(e.output) for e in self.eval) / outputs) if outputs else None

    def _pack(self, examples: list[Example]) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(examples), self.seq_len + 1), self.eos_id, np.int32)
        mask = np.zeros((len(examples), self.seq_len), np.uint8)
        for row, example in enumerate(examples):
            tokens[row, :len(example.ids)] = example.ids
            # Target j predicts tokens[j + 1]: an output token (or the EOS) once j + 1 >= input_len.
            mask[row, max(0, example.input_len - 1):len(example.ids) - 1] = 1
        return tokens, mask

    def _train_rows(self, step: int) -> np.ndarray:
        rows = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, positions = np.divmod(rows, len(self.train))
        chosen = np.empty_like(rows)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(len(self.train))
            chosen[epochs == epoch] = order[positions[epochs == epoch]]
        return chosen

    def batch(self, step: int) -> np.ndarray:
        """The training tokens of `step`, a function of (seed, step)."""
        return self._train_tokens[self._train_rows(step)]

    def loss_mask(self, step: int) -> np.ndarray:
        """The targets of batch(step) the loss counts."""
        return self._train_mask[self._train_rows(step)]

    def epoch(self, step: int) -> float:
        """Epochs completed once `step` is done."""
        return (step + 1) * self.global_batch / len(self.train)

    def _eval_rows(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rows = index * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        real = rows < len(self.eval)     # a last, partial batch is filled with rows that count nothing
        return np.where(real, rows, 0), real

    def eval_batch(self, index: int) -> np.ndarray:
        """Held-out batch `index`: the held-out examples in order."""
        rows, _ = self._eval_rows(index)
        return self._eval_tokens[rows]

    def eval_loss_mask(self, index: int) -> np.ndarray:
        rows, real = self._eval_rows(index)
        return self._eval_mask[rows] * real[:, None].astype(np.uint8)
