"""Config loading: TOML + overrides, validation errors that name the field, JSON round trip."""
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
    assert sorted(p.name for p in (ROOT / "configs").glob("*.toml")) == ["bench.toml", "default.toml", "tiny.toml"]
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


def test_overlap_with_microbatches_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="model.microbatches: must be 1 with dcn.overlap"):
        load_config(None, ["dcn.overlap=true", "model.microbatches=2"])
    assert load_config(None, ["dcn.overlap=false", "model.microbatches=2"]).model.microbatches == 2


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
    assert load_config(None, ["run.eval_every=50"]).run.eval_every == 50
    with pytest.raises(ConfigError, match="run.eval_every"):
        load_config(None, ["run.eval_every=-1"])


def test_load_config_reports_the_keys_the_user_gave(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nvocab_size = 512\n")
    given: set = set()
    load_config(str(path), ["run.steps=3"], given)
    assert given == {"model.vocab_size", "run.steps"}


def test_run_policies_load_as_enum_members_and_an_unknown_one_lists_the_choices():
    from multipod.controller.core.policies import OnPodFailure, OnSpike
    config = load_config(None, ['run.on_spike="rewind"', 'run.on_pod_failure="restore"'])
    assert config.run.on_spike is OnSpike.REWIND and config.run.on_pod_failure is OnPodFailure.RESTORE
    assert Config.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match=r"^run.on_spike: must be one of none, rewind, got 'sometimes'$"):
        load_config(None, ['run.on_spike="sometimes"'])
    with pytest.raises(ConfigError, match=r"^run.on_pod_failure: must be one of degrade, restore, got 'retry'$"):
        load_config(None, ['run.on_pod_failure="retry"'])


def test_default_toml_is_the_built_in_defaults():
    """configs/default.toml spells out the default run (`multipod local` with no --config), and the
    worker's own defaults are the same run's."""
    assert load_config(str(ROOT / "configs" / "default.toml")) == Config()
    assert Config().worker_config() == WorkerConfig()


def test_the_workers_sections_are_imported_from_where_they_live():
    """The schema lives in pod_worker/schema.py (and ModelConfig in model/config.py), which the
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
