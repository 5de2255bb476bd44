"""What a training command checks before it starts a run (controller/commands/train.py)."""
import dataclasses

import pytest

from multipod.controller.commands.checkpoints import saved_steps
from multipod.controller.commands.train import check_no_earlier_run, check_something_to_resume, make_folder
from multipod.controller.core.run_config import ConfigError, load_config
from tests.helpers import TINY


def test_a_checkpoint_directory_s_steps_are_its_own_and_its_pods_parts(tmp_path):
    root = tmp_path / "checkpoints"
    assert saved_steps(root) == []                      # not there yet
    (root / "pod-x" / "7").mkdir(parents=True)          # not a pod's folder of parts
    (root / "notes").mkdir()
    assert saved_steps(root) == []
    for step in ("0", "4", "pod-0/4", "pod-0/8", "pod-1/12"):
        (root / step).mkdir(parents=True)
    assert saved_steps(root) == [0, 4, 8, 12]


def test_a_new_run_is_refused_where_an_earlier_run_s_checkpoints_are(tmp_path):
    """Without --resume, a run whose checkpoint directory holds another run's step folders would
    mix its checkpoints with them: refused, naming the directory and what to do."""
    config = load_config(TINY)
    run_dir = tmp_path / "run"
    check_no_earlier_run(config, run_dir)               # a new directory
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "run_config.json").write_text("{}")
    check_no_earlier_run(config, run_dir)               # a run that saved nothing yet
    (run_dir / "checkpoints" / "pod-0" / "6").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"--run-dir: .*checkpoints already holds an earlier run's checkpoints "
                                          r"\(steps 6\): --resume continues that run"):
        check_no_earlier_run(config, run_dir)
    shared = tmp_path / "shared"
    for step in range(5):
        (shared / str(step)).mkdir(parents=True)
    elsewhere = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(shared)))
    with pytest.raises(ConfigError, match=r"checkpoint.dir: .* \(steps \.\.\., 2, 3, 4\): .*another --checkpoint-dir"):
        check_no_earlier_run(elsewhere, tmp_path / "another-run")


def test_a_run_s_folders_are_made_or_refused_naming_the_field(tmp_path):
    make_folder(tmp_path / "a" / "b", "--run-dir")          # parents too
    make_folder(tmp_path / "a" / "b", "--run-dir")          # there already
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .*file is a file, not a folder"):
        make_folder(tmp_path / "file", "checkpoint.dir")
    with pytest.raises(ConfigError, match=r"--run-dir: cannot create the folder .*file/sub: Not a directory"):
        make_folder(tmp_path / "file" / "sub", "--run-dir")


def test_a_local_resume_needs_a_checkpoint_or_a_warm_start(tmp_path):
    config = load_config(TINY)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--resume: no checkpoint to resume from in .*run/checkpoints"):
        check_something_to_resume(config, run_dir)                  # no such run
    (run_dir / "checkpoints" / "pod-1" / "6").mkdir(parents=True)   # a DiLoCo pod's part is a checkpoint
    check_something_to_resume(config, run_dir)
    warm = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint,
                                                                      warm_start_from=str(tmp_path / "other")))
    check_something_to_resume(warm, tmp_path / "new-run")           # begins from the other run's checkpoint
