"""`multipod tune` refuses an output file it could not write before its search starts
(controller/commands/tune.py: check_outputs), whichever mode: layout, --inference or --dcn."""
import argparse

import pytest

from multipod.controller.commands.tune import check_outputs
from multipod.controller.core.run_config import ConfigError


def _args(tmp_path, **given) -> argparse.Namespace:
    values = {"out": str(tmp_path / "tuned.toml"), "json_path": None, "plan_out": None, **given}
    return argparse.Namespace(**values)


def test_every_output_is_checked_before_the_search(tmp_path):
    check_outputs(_args(tmp_path))
    check_outputs(_args(tmp_path, json_path=str(tmp_path / "t.json"), plan_out=str(tmp_path / "plan.toml")))
    cases = {"--out": dict(out=str(tmp_path / "missing" / "tuned.toml")),
             "--json": dict(json_path=str(tmp_path / "missing" / "t.json")),
             "--plan-out": dict(plan_out=str(tmp_path / "missing" / "p.toml"))}
    for flag, given in cases.items():
        with pytest.raises(ConfigError, match=f"{flag}: .* cannot be written"):
            check_outputs(_args(tmp_path, **given))
    with pytest.raises(ConfigError, match="--out: .* is a directory"):
        check_outputs(_args(tmp_path, out=str(tmp_path)))
