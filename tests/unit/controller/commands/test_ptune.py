"""`multipod ptune`'s config, derived from the base checkpoint and the task (controller/commands/ptune.py)."""
import argparse
import dataclasses
import json

import pytest

from multipod.controller.commands.checkpoints import GenerateError
from multipod.controller.commands.ptune import add_arguments, derived_overrides
from multipod.controller.core.run_config import Config, load_config
from multipod.model import ModelConfig


def _base(tmp_path, **model):
    """A checkpoint directory as a run leaves it: run_config.json and step folders 3 and 5."""
    root = tmp_path / "base" / "checkpoints"
    for step in (3, 5):
        (root / str(step)).mkdir(parents=True)
    config = dataclasses.replace(Config(), model=ModelConfig(max_seq_len=32, **model),
                                 data=dataclasses.replace(Config().data, seq_len=16))
    raw = config.to_dict()
    raw["data"]["tokenizer"] = "bytes"
    (root / "run_config.json").write_text(json.dumps(raw))
    task = tmp_path / "task.jsonl"
    task.write_text('{"input": "ab=", "output": "ab"}\n{"input": "abcd=", "output": "abcd"}\n')
    return root, task


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--data")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--run-dir")
    return parser.parse_args(list(argv))


def _config(overrides):
    return load_config(None, overrides)


def test_the_config_is_the_base_s_model_and_tokenizer_with_the_task_and_the_newest_base_step(tmp_path):
    root, task = _base(tmp_path, microbatches=2)
    config = _config(derived_overrides(_args("--checkpoint", str(root), "--data", str(task), "--virtual-tokens", "4")))
    assert config.prompt.kind == "prompt" and config.prompt.virtual_tokens == 4
    assert config.prompt.base_checkpoint == str(root / "5")
    assert config.model.max_seq_len == 32 and config.data.tokenizer == "bytes"
    # The longest example, "abcd=" + "abcd" + end: 10 tokens, so 9 targets.
    assert config.data.seq_len == 9
    # The base trained with microbatches, a layout prompt tuning does not run: reset, not refused.
    assert config.model.microbatches == 1
    assert config.optimizer.weight_decay == 0.0


def test_resume_keeps_the_base_step_the_run_began_on(tmp_path):
    root, task = _base(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"prompt": {"base_checkpoint": str(root / "3")}}))
    args = _args("--checkpoint", str(root), "--data", str(task), "--resume", "--run-dir", str(run_dir))
    assert _config(derived_overrides(args)).prompt.base_checkpoint == str(root / "3")


def test_a_prompt_checkpoint_as_the_base_and_too_many_virtual_tokens_are_refused(tmp_path):
    root, task = _base(tmp_path)
    raw = json.loads((root / "run_config.json").read_text())
    raw["prompt"] = {"kind": "mlp", "base_checkpoint": "/somewhere/7"}
    (root / "run_config.json").write_text(json.dumps(raw))
    with pytest.raises(GenerateError, match="is a prompt checkpoint .*/somewhere/7"):
        derived_overrides(_args("--checkpoint", str(root), "--data", str(task)))
    root2, task2 = _base(tmp_path / "other")
    from multipod.controller.data.batches import DataError
    with pytest.raises(DataError, match="room for 8"):
        derived_overrides(_args("--checkpoint", str(root2), "--data", str(task2), "--virtual-tokens", "25"))


def test_a_base_written_before_the_components_had_sections_still_loads(tmp_path):
    """A run_config.json of an older version holds the checkpoint, eval, sample, recovery, health
    and spike keys under [run]: generate and ptune read it as the sections hold them now."""
    from multipod.controller.commands.generate import load_run
    root, task = _base(tmp_path)
    raw = json.loads((root / "run_config.json").read_text())
    for section in ("checkpoint", "eval", "sample", "recovery", "health", "spike"):
        del raw[section]
    del raw["run"]["fingerprint_every"]
    raw["run"].update(checkpoint_every=7, eval_every=9, sample_temperature=0.25, on_spike="rewind",
                      health_timeout_s=4.0, full_fingerprint_every=11)
    (root / "run_config.json").write_text(json.dumps(raw))
    config, _ = load_run(root)
    assert (config.checkpoint.every, config.eval.every, config.sample.temperature, config.spike.policy,
            config.health.timeout_s, config.run.fingerprint_every) == (7, 9, 0.25, "rewind", 4.0, 11)
    tuned = _config(derived_overrides(_args("--checkpoint", str(root), "--data", str(task))))
    assert tuned.prompt.base_checkpoint == str(root / "5") and tuned.eval.every == 25
