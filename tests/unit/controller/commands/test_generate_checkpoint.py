"""What `multipod generate --checkpoint` (and ptune's) accepts: a run's checkpoint directory, one
of its step folders, the run directory, and a DiLoCo run's per-pod parts (controller/commands/checkpoints.py)."""
import pytest

from multipod.controller.commands.checkpoints import GenerateError, find_checkpoint, newest_step


def _every_step(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (3, 12):
        (root / str(step)).mkdir(parents=True)
    (root / "run_config.json").write_text("{}")
    return root


def _diloco(tmp_path):
    """As a DiLoCo run leaves it: each pod's part of every checkpoint under pod-N."""
    root = tmp_path / "run" / "checkpoints"
    for pod in (0, 1):
        for step in (0, 6, 12):
            (root / f"pod-{pod}" / str(step)).mkdir(parents=True)
    (root / "run_config.json").write_text("{}")
    return root


def test_an_every_step_run_s_checkpoints_resolve_to_their_newest_step_or_the_one_named(tmp_path):
    root = _every_step(tmp_path)
    for given in (root, root.parent):
        found = find_checkpoint(str(given))
        assert (found.root, found.path, found.steps) == (root, None, root)
        assert newest_step(found) == root / "12"
    found = find_checkpoint(str(root / "3"))
    assert (found.root, found.path, found.steps) == (root, root / "3", root)


def test_a_diloco_run_s_checkpoints_resolve_to_a_pod_s_part(tmp_path):
    root = _diloco(tmp_path)
    for given in (root, root.parent):     # the newest checkpoint: pod 0's part of it
        found = find_checkpoint(str(given))
        assert (found.root, found.path, found.steps) == (root, None, root / "pod-0")
        assert newest_step(found) == root / "pod-0" / "12"
    found = find_checkpoint(str(root / "pod-1"))
    assert (found.root, found.path, found.steps) == (root, None, root / "pod-1")
    found = find_checkpoint(str(root / "pod-1" / "6"))
    assert (found.root, found.path, found.steps) == (root, root / "pod-1" / "6", root / "pod-1")


def test_a_diloco_run_warm_started_in_the_every_step_run_s_directory_resolves_to_its_newest_part(tmp_path):
    """A DiLoCo warm start (--resume with sync.mode = diloco) leaves the every-step run's step
    folders beside the parts: the newest checkpoint is the parts' newest, and on a tie (the warm
    start's own first part) the part."""
    root = _every_step(tmp_path)                    # every step to 12
    for step in (12, 18, 24):
        (root / "pod-0" / str(step)).mkdir(parents=True)
    found = find_checkpoint(str(root))
    assert (found.steps, newest_step(found), found.is_part) == (root / "pod-0", root / "pod-0" / "24", True)
    found = find_checkpoint(str(root / "3"))        # an every-step folder named: restored as every-step state
    assert (found.path, found.is_part) == (root / "3", False)
    for step in (18, 24):
        (root / "pod-0" / str(step)).rmdir()
    assert newest_step(find_checkpoint(str(root))) == root / "pod-0" / "12"
    (root / "30").mkdir()       # every-step steps newer than any part
    assert newest_step(find_checkpoint(str(root))) == root / "30"


def test_generation_configures_the_sync_mode_of_the_folder_it_restores():
    """The pod that generates from a DiLoCo run's config restores an every-step folder (kept from
    before a warm start) as every-step state, and a part as the run's DiLoCo state."""
    import dataclasses

    from multipod.controller.commands.generate import _worker_config
    from multipod.controller.core.run_config import load_config
    from multipod.pod_worker.schema import SyncMode
    from tests.helpers import TINY
    plain = load_config(TINY)
    diloco = dataclasses.replace(plain, sync=dataclasses.replace(plain.sync, mode=SyncMode.DILOCO, inner_steps=3))
    assert _worker_config(diloco, 1, diloco_part=True).sync == diloco.sync
    assert _worker_config(diloco, 1, diloco_part=False).sync == plain.sync
    assert _worker_config(plain, 1, diloco_part=False).sync == plain.sync
    assert _worker_config(diloco, 2, diloco_part=False).worker_config().state_key() == \
        _worker_config(plain, 2, diloco_part=False).worker_config().state_key()


def test_a_checkpoint_directory_without_steps_is_refused_naming_it(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "pod-0").mkdir(parents=True)
    (root / "run_config.json").write_text("{}")
    with pytest.raises(GenerateError, match="holds no checkpoint yet"):
        find_checkpoint(str(root))
    with pytest.raises(GenerateError, match="holds no checkpoint yet"):
        find_checkpoint(str(root / "pod-0"))
    (root / "pod-x" / "5").mkdir(parents=True)      # not a pod's folder: not taken for one
    with pytest.raises(GenerateError, match="no run_config.json"):
        find_checkpoint(str(root / "pod-x" / "5"))
