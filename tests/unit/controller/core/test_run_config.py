"""Config loading: TOML + overrides, validation errors that name the field, JSON round trip."""
import json

import pytest

from multipod.controller.core.run_config import Config, ConfigError, load_config, parse_override
from multipod.pod_worker.schema import WorkerConfig

ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]


def test_defaults_validate_and_round_trip_through_json():
    config = load_config()
    assert Config.from_json(config.to_json()) == config
    worker = config.worker_config()
    assert WorkerConfig.from_json(worker.to_json()) == worker
    assert worker.config_hash() == WorkerConfig.from_json(worker.to_json()).config_hash()


def test_toml_file_and_overrides_layer_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nd_model = 64\n[run]\nsteps = 7\n")
    config = load_config(str(path), ["run.steps=9", "optimizer.learning_rate=1e-3", "data.path=" + str(path)])
    assert config.model.d_model == 64
    assert config.run.steps == 9
    assert config.optimizer.learning_rate == 1e-3
    assert config.data.path == str(path)


def test_shipped_configs_load():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.toml")) == ["bench.toml", "default.toml", "tiny.toml",
                                                                         "vs_maxtext.toml"]
    for path in sorted((ROOT / "configs").glob("*.toml")):
        load_config(str(path))


@pytest.mark.parametrize("overrides, field", [
    (["model.d_modle=3"], "model.d_modle"),
    (["modle.d_model=3"], "modle"),
    (["model.d_model=abc"], "model.d_model"),
    (["model.d_model=-4"], "model.d_model"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
    (["optimizer.b2=1.5"], "optimizer.b2"),
    (["run.steps=0"], "run.steps"),
    (["run.steps=true"], "run.steps"),
    (["dcn.chunk_bytes=100"], "dcn.chunk_bytes"),
    (["data.seq_len=4096"], "data.seq_len"),
    (["data.path=/no/such/place"], "data.path"),
    (["run.fingerprint_every=-1"], "run.fingerprint_every"),
    (["checkpoint.keep=0"], "checkpoint.keep"),
    (["checkpoint.every=-1"], "checkpoint.every"),
    (["eval.batches=-1"], "eval.batches"),
    (["sample.temperature=-0.5"], "sample.temperature"),
    (["recovery.max_restarts=-1"], "recovery.max_restarts"),
    (["health.interval_s=0"], "health.interval_s"),
    (["health.progress_timeout_s=-1"], "health.progress_timeout_s"),
    (["spike.window=0"], "spike.window"),
    (["spike.skip_batches=-2"], "spike.skip_batches"),
])
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("no-equals-sign")
    with pytest.raises(ConfigError, match="section.key"):
        parse_override("toplevel=3")


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_mesh_resolution():
    config = load_config(None, ["mesh.model=2"])
    assert config.mesh.resolve(4) == (2, 2)
    with pytest.raises(ConfigError, match="mesh.model"):
        config.mesh.resolve(3)
    with pytest.raises(ConfigError, match="mesh.data"):
        load_config(None, ["mesh.data=3", "mesh.model=1"]).mesh.resolve(4)


def test_tiny_worker_config_helper_matches_the_controllers_projection():
    from tests.helpers import TINY, tiny_worker_config
    assert load_config(TINY).worker_config() == tiny_worker_config()


def test_worker_config_carries_the_run_shape_and_nothing_of_the_controller():
    config = load_config(None, ["run.steps=33", "run.seed=5", "data.seq_len=64", "data.global_batch=4"])
    worker = config.worker_config()
    shape = worker.train
    assert (shape.total_steps, shape.seed, shape.seq_len, shape.global_batch) == (33, 5, 64, 4)
    assert "path" not in worker.to_json() and "eval_batches" not in worker.to_json()


def test_overlap_is_auto_by_default_takes_true_false_and_auto_and_refuses_anything_else():
    from multipod.pod_worker.schema import Overlap
    assert Config().dcn.overlap is Overlap.AUTO
    # TOML's booleans, as a file or --set writes them, and the three names; microbatches overlap too.
    for value, want in (("true", Overlap.ON), ("false", Overlap.OFF), ("auto", Overlap.AUTO), ('"true"', Overlap.ON)):
        assert load_config(None, [f"dcn.overlap={value}", "model.microbatches=2"]).dcn.overlap is want, value
    with pytest.raises(ConfigError, match="dcn.overlap: must be one of auto, true, false, got 'sometimes'"):
        load_config(None, ["dcn.overlap=sometimes"])
    with pytest.raises(ConfigError, match="dcn.overlap: must be one of auto, true, false, got 1"):
        load_config(None, ["dcn.overlap=1"])
    # A config.json written when the field was a boolean reads back.
    assert Config.from_json(json.dumps({"dcn": {"overlap": True}})).dcn.overlap is Overlap.ON


@pytest.mark.parametrize("value, message", [
    ('"bpe:10"', "bpe:N needs N in"), ('"bpe:x"', "bpe:N needs N in"),
    ('"no/such/tokenizer.json"', "is not \"bytes\", \"bpe:N\" or an existing tokenizer file")])
def test_a_bad_tokenizer_names_data_tokenizer(value, message):
    with pytest.raises(ConfigError, match="data.tokenizer") as error:
        load_config(None, [f"data.tokenizer={value}"])
    assert message in str(error.value)


def test_tokenizer_kinds_and_eval_every(tmp_path):
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text("{}")       # existence is all the config checks; loading it is the tokenizer's job
    for value in ("bytes", "bpe:4096", str(tokenizer)):
        assert load_config(None, [f"data.tokenizer={value!r}".replace("'", '"')]).data.tokenizer == value
    assert load_config(None, ["data.tokenizer=\"bpe:300\""]).data.bpe_size() == 300
    assert load_config(None, ["eval.every=50"]).eval.every == 50
    with pytest.raises(ConfigError, match="eval.every"):
        load_config(None, ["eval.every=-1"])


def test_load_config_reports_the_keys_the_user_gave(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nvocab_size = 512\n")
    given: set = set()
    load_config(str(path), ["run.steps=3"], given)
    assert given == {"model.vocab_size", "run.steps"}


def test_run_policies_load_as_enum_members_and_an_unknown_one_lists_the_choices():
    from multipod.controller.core.policies import OnPodFailure, OnSpike
    config = load_config(None, ['spike.policy="rewind"', 'recovery.on_pod_failure="restore"'])
    assert config.spike.policy is OnSpike.REWIND and config.recovery.on_pod_failure is OnPodFailure.RESTORE
    assert Config.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match=r"^spike.policy: must be one of none, rewind, got 'sometimes'$"):
        load_config(None, ['spike.policy="sometimes"'])
    with pytest.raises(ConfigError, match=r"^recovery.on_pod_failure: must be one of degrade, restore, got 'retry'$"):
        load_config(None, ['recovery.on_pod_failure="retry"'])


def test_default_toml_is_the_built_in_defaults():
    """configs/default.toml spells out the default run (`multipod local` with no --config), and the
    worker's own defaults are the same run's."""
    assert load_config(str(ROOT / "configs" / "default.toml")) == Config()
    assert Config().worker_config() == WorkerConfig()


def test_the_workers_sections_are_imported_from_where_they_live():
    """The schema lives in the pod_worker/schema package (and ModelConfig in model/config.py), which the
    controller and the worker both import: nothing takes them through the controller's config."""
    import ast

    from multipod.controller.core import run_config
    shared = {"ModelConfig", "OptimizerConfig", "MeshConfig", "DcnConfig", "PromptConfig", "TrainShape",
              "WorkerConfig"}
    assert not shared & set(run_config.__all__)
    found = []
    for folder in ("controller", "pod_worker", "tests", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "multipod.controller.core.run_config":
                    found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name in shared]
    assert not found, found


def test_each_component_has_its_section_and_run_keeps_the_loop_s_own():
    from multipod.controller.core.run_config import CheckpointConfig, EvalConfig, SpikeConfig
    config = load_config(None, ["checkpoint.every=7", "checkpoint.keep=2", 'checkpoint.dir="/shared/c"',
                                "eval.every=5", "spike.window=4", "health.timeout_s=1.5", "run.steps=9"])
    assert config.checkpoint == CheckpointConfig(every=7, keep=2, dir="/shared/c")
    assert config.eval == EvalConfig(every=5) and config.spike == SpikeConfig(window=4)
    assert (config.health.timeout_s, config.run.steps) == (1.5, 9)
    run_keys = {name for name in Config().to_dict()["run"]}
    assert run_keys == {"steps", "seed", "peak_flops", "measure_peak", "fingerprint_every", "step_timeout_s",
                        "connect_timeout_s", "configure_timeout_s", "dispatch_depth"}


@pytest.mark.parametrize("old, new", [("checkpoint_every", "checkpoint.every"), ("on_spike", "spike.policy"),
                                      ("health_timeout_s", "health.timeout_s")])
def test_a_run_key_that_moved_is_refused_naming_where_it_lives_now(tmp_path, old, new):
    with pytest.raises(ConfigError, match=rf"^run.{old}: is {new} now$"):
        load_config(None, [f"run.{old}=1"])
    path = tmp_path / "old.toml"
    path.write_text(f"[run]\nsteps = 3\n{old} = 1\n")
    with pytest.raises(ConfigError, match=rf"^run.{old}: is {new} now$"):
        load_config(str(path))


def test_upgrade_moves_an_older_version_s_run_keys_to_their_sections():
    from multipod.controller.core.policies import OnPodFailure, OnSpike
    from multipod.controller.core.run_config import upgrade
    old = Config().to_dict()
    for section in ("checkpoint", "eval", "sample", "recovery", "health", "spike"):
        del old[section]
    del old["run"]["fingerprint_every"]
    old["run"].update(checkpoint_every=7, keep_checkpoints=2, checkpoint_dir="/c", eval_every=9, eval_batches=1,
                      sample_tokens=5, sample_prompt="x", sample_temperature=0.25, on_pod_failure="restore",
                      max_restarts=4, restart_timeout_s=9.0, health_interval_s=1.0, health_timeout_s=4.0,
                      progress_timeout_s=3.0, on_spike="rewind", spike_threshold=2.0, spike_window=6, skip_batches=2,
                      full_fingerprint_every=11)
    config = Config.from_dict(upgrade(old))
    assert (config.checkpoint.every, config.checkpoint.keep, config.checkpoint.dir) == (7, 2, "/c")
    assert (config.eval.every, config.eval.batches) == (9, 1)
    assert (config.sample.tokens, config.sample.prompt, config.sample.temperature) == (5, "x", 0.25)
    assert config.recovery.on_pod_failure is OnPodFailure.RESTORE
    assert (config.recovery.max_restarts, config.recovery.restart_timeout_s) == (4, 9.0)
    assert (config.health.interval_s, config.health.timeout_s, config.health.progress_timeout_s) == (1.0, 4.0, 3.0)
    assert config.spike == type(config.spike)(policy=OnSpike.REWIND, threshold=2.0, window=6, skip_batches=2)
    assert config.run.fingerprint_every == 11
    current = Config().to_dict()
    assert upgrade(current) == current       # a current config is left as it is
