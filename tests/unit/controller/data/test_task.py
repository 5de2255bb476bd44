"""A prompt-tuning task as batches: tokens, a loss mask over the output tokens, the held-out split,
and an order that is a function of (seed, step)."""
import json

import numpy as np
import pytest

from multipod.controller.data.batches import DataError
from multipod.controller.data.task import TaskDataset, needed_seq_len, read_examples
from multipod.controller.data.tokenizer import ByteTokenizer


def _task(tmp_path, records, name="task.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_mask_covers_the_output_and_its_end_token_only(tmp_path):
    tok = ByteTokenizer()
    examples = read_examples(_task(tmp_path, [{"input": "ab=", "output": "xy"}]), tok, "input", "output")
    data = TaskDataset(examples, seq_len=8, global_batch=2, seed=0, eos_id=tok.eos_id)
    tokens, mask = data.batch(0)[0], data.loss_mask(0)[0]
    assert tokens.tolist()[:6] == [ord(c) for c in "ab=xy"] + [tok.eos_id]
    # Target j is tokens[j + 1]: counted for "x", "y" and the end token, nothing else.
    counted = [int(tokens[j + 1]) for j in range(8) if mask[j]]
    assert counted == [ord("x"), ord("y"), tok.eos_id]
    assert needed_seq_len(examples) == 5


def test_every_tenth_example_is_held_out_and_a_partial_eval_batch_counts_nothing_twice(tmp_path):
    tok = ByteTokenizer()
    records = [{"input": f"{i}:", "output": "o" * (1 + i % 3)} for i in range(25)]
    data = TaskDataset(read_examples(_task(tmp_path, records), tok, "input", "output"), 8, 4, 0, tok.eos_id)
    assert [e.input for e in data.eval] == ["9:", "19:"] and len(data.train) == 23
    assert data.num_eval_batches == 1
    mask = data.eval_loss_mask(0)
    assert mask[:2].sum() == sum(len(e.output) + 1 for e in data.eval) and mask[2:].sum() == 0
    assert data.eval_bytes_per_token == pytest.approx(3 / 5)     # "o" + "ooo" over 2 outputs + 2 end tokens


def test_the_batch_of_a_step_depends_on_the_seed_and_step_only_and_an_epoch_sees_every_example(tmp_path):
    tok = ByteTokenizer()
    records = [{"input": f"{i:02d}=", "output": "z"} for i in range(12)]
    examples = read_examples(_task(tmp_path, records), tok, "input", "output")
    one, two = TaskDataset(examples, 6, 4, 7, tok.eos_id), TaskDataset(examples, 6, 4, 7, tok.eos_id)
    assert np.array_equal(one.batch(5), two.batch(5)) and np.array_equal(one.loss_mask(5), two.loss_mask(5))
    seen = np.concatenate([one.batch(s) for s in range(3)])      # 12 examples, 3 batches of 4: one epoch
    assert sorted(bytes(r[:2].astype(np.uint8)).decode() for r in seen) == [f"{i:02d}" for i in range(12)]
    assert not np.array_equal(TaskDataset(examples, 6, 4, 8, tok.eos_id).batch(0), one.batch(0))


@pytest.mark.parametrize("records, field, message", [
    ([{"input": "a", "answer": "b"}], "output", r"task\.jsonl:1: no 'output' field"),
    ([{"input": "a", "output": 3}], "output", r"task\.jsonl:1: field 'output' is int"),
    ([{"input": "a", "output": ""}], "output", r"task\.jsonl:1: the output is empty"),
    ([], "output", r"an empty jsonl file \(no example"),
])
def test_bad_examples_are_refused_naming_the_line(tmp_path, records, field, message):
    with pytest.raises(DataError, match=message):
        read_examples(_task(tmp_path, records), ByteTokenizer(), "input", field)


def test_a_task_file_that_is_missing_or_a_folder_is_refused_naming_it(tmp_path):
    # multipod ptune --data with a wrong path ended in a FileNotFoundError traceback.
    with pytest.raises(DataError, match=r"nothing\.jsonl: no such file"):
        read_examples(str(tmp_path / "nothing.jsonl"), ByteTokenizer(), "input", "output")
    with pytest.raises(DataError, match="a folder, not a .jsonl file"):
        read_examples(str(tmp_path), ByteTokenizer(), "input", "output")


def test_an_example_longer_than_the_sequence_is_refused_naming_it(tmp_path):
    tok = ByteTokenizer()
    examples = read_examples(_task(tmp_path, [{"input": "a", "output": "b"}, {"input": "long=", "output": "xyz"}]),
                             tok, "input", "output")
    with pytest.raises(DataError, match=r"task\.jsonl:2: input \+ output \+ end-of-text are 9 tokens"):
        TaskDataset(examples, seq_len=6, global_batch=2, seed=0, eos_id=tok.eos_id)
