"""The training flags every run shares map to their config keys (controller/commands/options.py)."""
import argparse

import pytest

from multipod.controller.commands.options import add_train_options, resolve_config
from multipod.controller.core.policies import OnSpike


def _resolve(*argv):
    parser = argparse.ArgumentParser()
    add_train_options(parser)
    return resolve_config(parser.parse_args(list(argv)))


def test_the_dedicated_flags_set_their_sections_keys(tmp_path):
    config = _resolve("--steps", "7", "--seed", "3", "--eval-every", "5", "--checkpoint-every", "4",
                      "--checkpoint-dir", str(tmp_path / "c"), "--max-restarts", "2", "--on-spike", "rewind",
                      "--skip-batches", "6", "--no-peak")
    assert (config.run.steps, config.run.seed, config.run.measure_peak) == (7, 3, False)
    assert config.eval.every == 5
    assert (config.checkpoint.every, config.checkpoint.dir) == (4, str(tmp_path / "c"))
    assert config.recovery.max_restarts == 2
    assert (config.spike.policy, config.spike.skip_batches) == (OnSpike.REWIND, 6)


def test_on_spike_takes_only_the_policies():
    with pytest.raises(SystemExit):
        _resolve("--on-spike", "sometimes")
