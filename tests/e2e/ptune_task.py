"""The toy task of the prompt-tuning tests, written into a test's folder: a base corpus of lines in
two modes, "A>" followed by letters from abcd and "B>" followed by letters from wxyz, and a task
whose input is ">" alone and whose output is an A-mode line. A base model trained on the corpus
cannot tell from ">" which mode is wanted (half its lines are each); a learned prompt can. The task
also ends each output with the end-of-text token, which the base only saw after a document's last
line: the prompt learns that too (test_ptune.py)."""
from __future__ import annotations

import json
import pathlib
import random


def write(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(corpus.jsonl, task.jsonl) in `folder`, the same every time."""
    rng = random.Random(1)

    def line(letters: str) -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(4, 8)))

    corpus, task = folder / "corpus.jsonl", folder / "task.jsonl"
    with corpus.open("w") as out:
        for _ in range(400):
            lines = [f"A>{line('abcd')}" if rng.random() < 0.5 else f"B>{line('wxyz')}" for _ in range(4)]
            out.write(json.dumps({"text": "\n".join(lines) + "\n"}) + "\n")
    with task.open("w") as out:
        for _ in range(200):
            out.write(json.dumps({"input": ">", "output": line("abcd")}) + "\n")
    return corpus, task
