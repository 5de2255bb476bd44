"""`multipod ptune`: prompt tuning or p-tuning of a trained model on a task, across pods.

It is a training run like any other (the same controller, step loop, DCN exchange, checkpoints,
degraded mode and resume), configured from the base checkpoint: its model and tokenizer, a
[prompt] section naming the base's step folder, and data.path the task's .jsonl. The pods then
train the prompt parameters alone (pod_worker/prompt_trainer.py) and the run's checkpoints are
the prompt checkpoints, a few kilobytes each, which `multipod generate --prompt-checkpoint` uses.

Defaults that differ from training a model: AdamW without weight decay (it would pull the
virtual tokens towards 0), a short warmup, 100 steps, a batch of 8, evaluation every 25 steps, and
data.seq_len just long enough for the longest example. --set changes any of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="the base model: a run's checkpoint directory (its newest checkpoint) or one step folder")
    # Checked by the config (prompt.kind, model/prompt.py PROMPT_KINDS): importing the model here
    # would load jax for `multipod --help`.
    parser.add_argument("--kind", default="prompt",
                        help="prompt: learn the virtual tokens' embeddings (prompt tuning); mlp, lstm: learn a prompt "
                             "encoder that makes them (p-tuning) (default prompt)")
    parser.add_argument("--virtual-tokens", type=int, default=10, help="virtual tokens before every input (default 10)")
    parser.add_argument("--hidden", type=int, default=128, help="the prompt encoder's hidden width (mlp, lstm)")
    parser.add_argument("--input-field", default="input", help="the field of a task record holding its input")
    parser.add_argument("--output-field", default="output", help="the field holding the output to learn")
    parser.add_argument("--workers", metavar="ADDRESSES",
                        help="run on these pod workers (as multipod train --workers) instead of simulated local pods")


def derived_overrides(args) -> list[str]:
    """The config of a prompt-tuning run as `section.key=value` overrides, from the base checkpoint
    and the task: the user's --set come after them. GenerateError or DataError naming what cannot
    be used (a missing checkpoint, a task file, an example too long for the context)."""
    from multipod.controller.commands.checkpoints import GenerateError, find_checkpoint, newest_step
    from multipod.controller.commands.generate import load_run
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.data.batches import DataError
    from multipod.controller.data.corpus import TOKENIZER_FILES
    from multipod.controller.data.task import HOLD_OUT_EVERY, MIN_FOR_HOLD_OUT, needed_seq_len, read_examples
    if not args.data:
        raise ConfigError("--data", "give the task: a .jsonl of records with an input and an output")
    if args.virtual_tokens < 1:
        raise ConfigError("--virtual-tokens", f"must be >= 1, got {args.virtual_tokens}")
    base = find_checkpoint(args.checkpoint)
    folder = base.path or newest_step(base)
    config, tokenizer = load_run(base.root)
    if config.prompt.enabled:
        raise GenerateError(f"--checkpoint {args.checkpoint} is a prompt checkpoint (of a multipod ptune run): give "
                            f"the checkpoint of the base model it was tuned on ({config.prompt.base_checkpoint})")
    resumed = _resumed_base(args)
    if resumed is not None:
        folder = resumed    # --resume: the base the run began on, even if the base run saved newer steps since
    # Microbatches are a layout of the base's training that prompt tuning does not run (it refuses them).
    model = dataclasses.replace(config.model, microbatches=1)
    examples = read_examples(args.data, tokenizer, args.input_field, args.output_field)
    room = model.max_seq_len - args.virtual_tokens
    seq_len = needed_seq_len(examples)
    if room < 1:
        raise ConfigError("--virtual-tokens", f"{args.virtual_tokens} leave no room in the base model's context of "
                          f"{model.max_seq_len} tokens")
    if seq_len > room:
        longest = max(examples, key=lambda e: len(e.ids))
        raise DataError(f"{longest.where}: input + output + end-of-text are {len(longest.ids)} tokens; after "
                        f"{args.virtual_tokens} virtual tokens the base model's context of {model.max_seq_len} has "
                        f"room for {room + 1}")
    tokenizer_file = next((base.root / name for name in TOKENIZER_FILES.values() if (base.root / name).is_file()),
                          None)
    settings = {f"model.{key}": value for key, value in dataclasses.asdict(model).items()}
    held_out = examples[HOLD_OUT_EVERY - 1] if len(examples) >= MIN_FOR_HOLD_OUT else examples[0]
    settings.update({
        "data.path": args.data, "data.seq_len": seq_len, "data.global_batch": 8,
        "data.tokenizer": str(tokenizer_file) if tokenizer_file else "bytes",
        "data.input_field": args.input_field, "data.output_field": args.output_field,
        "optimizer.learning_rate": 3e-2, "optimizer.weight_decay": 0.0, "optimizer.warmup_steps": 10,
        "run.steps": 100, "eval.every": 25, "sample.temperature": 0.0,
        "sample.prompt": held_out.input, "sample.tokens": min(32, room - 1),
        "prompt.kind": args.kind, "prompt.virtual_tokens": args.virtual_tokens, "prompt.hidden": args.hidden,
        "prompt.base_checkpoint": str(folder),
    })
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def _resumed_base(args):
    """With --resume: the base step folder the run being continued was tuned on (its config.json
    in --run-dir), or None."""
    if not (args.resume and args.run_dir):
        return None
    try:
        saved = json.loads((pathlib.Path(args.run_dir) / "config.json").read_text())
        return saved["prompt"]["base_checkpoint"] or None
    except (OSError, ValueError, KeyError, TypeError):
        return None
