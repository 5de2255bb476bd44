"""The worker's config schema: the typed loader, what the worker sees, what its state depends on."""
import dataclasses
import json

import pytest

from multipod.model import ConfigError, ModelConfig
from multipod.pod_worker.schema import (
    DcnConfig,
    OptimizerConfig,
    TrainShape,
    WorkerConfig,
    build,
    streams_for_cpus,
    streams_per_peer,
    this_host_cpus,
)


def test_loader_rejects_unknown_and_bad_values_naming_the_field():
    assert build(ModelConfig, {"d_model": 64}, "model").d_model == 64
    with pytest.raises(ConfigError, match="model.d_modle: unknown key; model has: vocab_size"):
        build(ModelConfig, {"d_modle": 64}, "model")
    with pytest.raises(ConfigError, match="model.n_heads"):
        build(ModelConfig, {"n_heads": 0}, "model").validate()
    with pytest.raises(ConfigError, match="model.d_model: expected int, got str"):
        build(ModelConfig, {"d_model": "64"}, "model")
    assert build(OptimizerConfig, {"learning_rate": 1}, "optimizer").learning_rate == 1.0


def test_the_worker_config_holds_no_controller_concerns():
    sections = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert sections == {"model", "optimizer", "mesh", "dcn", "train", "prompt", "sync"}
    with pytest.raises(ConfigError, match="data: unknown section"):
        WorkerConfig.from_json('{"data": {"path": "/nowhere"}}')
    with pytest.raises(ConfigError, match="run: unknown section"):
        WorkerConfig.from_json('{"run": {"debug_nan_step": 2}}')


def test_worker_config_round_trips_and_validates():
    config = WorkerConfig(train=TrainShape(seq_len=64, global_batch=8, total_steps=10, seed=3))
    assert WorkerConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="train.seq_len"):
        WorkerConfig.from_json(WorkerConfig(train=TrainShape(seq_len=4096)).to_json())
    with pytest.raises(ConfigError, match="dcn.compression"):
        WorkerConfig(dcn=DcnConfig(compression="zip")).validate()


def test_state_key_covers_the_schedule_length():
    short = WorkerConfig(train=TrainShape(total_steps=10))
    long = WorkerConfig(train=TrainShape(total_steps=20))
    assert short.state_key() != long.state_key()     # the cosine decays over total_steps
    fixed = OptimizerConfig(decay_steps=100)
    assert dataclasses.replace(short, optimizer=fixed).state_key() == \
        dataclasses.replace(long, optimizer=fixed).state_key()   # an explicit decay length decides alone
    assert WorkerConfig(dcn=DcnConfig(streams=1)).state_key() == WorkerConfig().state_key()


def test_dcn_streams_are_a_count_or_auto_one_per_two_cpus():
    assert DcnConfig().streams == "auto"
    assert [streams_for_cpus(c) for c in (1, 2, 3, 4, 6, 8, 64)] == [1, 1, 1, 2, 3, 4, 4]
    assert streams_per_peer("auto", cpus=2) == 1 and streams_per_peer("auto", cpus=16) == 4
    assert [streams_for_cpus(c, overlapped=True) for c in (1, 2, 8)] == [4, 4, 4]
    assert streams_per_peer("auto", overlapped=True, cpus=2) == 4
    assert streams_per_peer(3, cpus=2) == 3      # a number decides alone
    assert streams_per_peer("auto") == streams_for_cpus(this_host_cpus())
    for raw, count in (("auto", "auto"), (1, 1), (8, 8)):
        loaded = build(DcnConfig, {"streams": raw}, "dcn")
        loaded.validate()
        assert loaded.streams == count and WorkerConfig.from_json(WorkerConfig(dcn=loaded).to_json()).dcn == loaded
    for raw, message in (("three", "dcn.streams: expected int or 'auto', got str 'three'"),
                         (True, "dcn.streams: expected int or 'auto', got bool"),
                         (2.5, "dcn.streams: expected int or 'auto', got float")):
        with pytest.raises(ConfigError, match=message):
            build(DcnConfig, {"streams": raw}, "dcn")
    for raw in (0, 9):
        with pytest.raises(ConfigError, match=r'dcn.streams: must be "auto" or an integer in \[1, 8\]'):
            build(DcnConfig, {"streams": raw}, "dcn").validate()



def test_choices_load_as_enum_members_and_travel_as_plain_strings():
    from multipod.model.config import RematPolicy
    from multipod.model.prompt import PromptKind
    from multipod.pod_worker.schema import Compression, PromptConfig
    config = build(WorkerConfig, {"model": {"remat": "full"}, "dcn": {"compression": "int8"}, "train": {"seq_len": 64},
                                  "prompt": {"kind": "mlp", "base_checkpoint": "/base/3"}})
    assert config.model.remat is RematPolicy.FULL and config.dcn.compression is Compression.INT8
    assert config.prompt.kind is PromptKind.MLP
    assert config.model.remat == "full"       # str enums: a plain string still compares equal
    data = json.loads(config.to_json())
    assert (data["model"]["remat"], data["dcn"]["compression"], data["prompt"]["kind"]) == ("full", "int8", "mlp")
    assert all(type(v) is str for v in (data["model"]["remat"], data["dcn"]["compression"], data["prompt"]["kind"]))
    assert WorkerConfig.from_json(config.to_json()) == config
    # No prompt tuning: kind is None, written "" (TOML has no null) and read back as None.
    assert PromptConfig().kind is None and PromptConfig(kind="").kind is None
    assert json.loads(WorkerConfig().to_json())["prompt"]["kind"] == ""
    assert WorkerConfig.from_json(WorkerConfig().to_json()).prompt.kind is None
    # A plain string given in Python is held as the member too.
    assert DcnConfig(compression="bf16").compression is Compression.BF16


@pytest.mark.parametrize("section, key, choices", [
    ("model", "remat", "none, full, selective"),
    ("dcn", "compression", "none, bf16, int8, int4"),
    ("sync", "outer_dtype", "float32, bf16, int8, int4"),
    ("sync", "on_pod_failure", "replay, drop"),
    ("prompt", "kind", "prompt, mlp, lstm"),
    ("dcn", "overlap", "auto, true, false"),
])
def test_an_unknown_choice_names_the_field_and_lists_the_choices(section, key, choices):
    with pytest.raises(ConfigError) as error:
        build(WorkerConfig, {section: {key: "bogus"}})
    assert error.value.field == f"{section}.{key}"
    assert str(error.value) == f"{section}.{key}: must be one of {choices}, got 'bogus'"
