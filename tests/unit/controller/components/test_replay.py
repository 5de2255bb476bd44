"""DiLoCo's replay history, seen from the controller before a run (components/replay.py
history_warning): a run whose checkpoint interval lets each pod's history of outer steps outgrow
sync.replay_history_mb is warned at its start, naming both remedies with numbers; one that fits,
or that does not replay, is not."""
from __future__ import annotations

from multipod.controller.components.replay import history_warning
from multipod.controller.core.run_config import load_config

BENCH = "configs/bench.toml"
PARAMS = 3_800_000      # about bench.toml's model: 15.2 MB of float32 values


def _config(*overrides: str):
    return load_config(BENCH, ["run.steps=600", "sync.mode=diloco", *overrides])


def test_every_step_sync_without_checkpoints_is_warned_with_the_interval_that_fits():
    # H = 1: a copy of the model every step; 2 GiB hold about 141 of them (the run that was
    # OOM-killed before the bound forgot its history at steps 142, 284, ...).
    warning = history_warning(_config("sync.inner_steps=1", "checkpoint.every=0"), PARAMS)
    assert warning is not None
    assert "holds the outer steps of about 141 inner steps" in warning
    assert "checkpoint.every = 0" in warning and "600" in warning
    assert "every 70 steps or fewer" in warning
    # The bound the warning asks for makes it go away.
    raise_to = int(warning.rsplit(" ", 1)[1])
    assert history_warning(_config("sync.inner_steps=1", "checkpoint.every=0",
                                   f"sync.replay_history_mb={raise_to}"), PARAMS) is None
    assert history_warning(_config("sync.inner_steps=1", "checkpoint.every=70"), PARAMS) is None


def test_a_history_that_fits_or_is_never_replayed_is_not_warned():
    # H = 20, 4 fragments: 120 outer steps of a quarter of the model, about 456 MB.
    assert history_warning(_config("sync.inner_steps=20", "sync.fragments=4", "checkpoint.every=0"), PARAMS) is None
    assert history_warning(_config("sync.inner_steps=1", "checkpoint.every=0", "sync.on_pod_failure=drop"),
                           PARAMS) is None
    assert history_warning(load_config(BENCH, ["run.steps=600", "checkpoint.every=0"]), PARAMS) is None
