"""The package ladder (docs/architecture.md), read from the source: which package may import which.

model and protos import nothing of ours (protos only itself); pod_worker imports model and protos;
the controller imports model, protos and, of pod_worker, only the schema it publishes
(the pod_worker/schema package). The root cli.py is the one entry module that knows both sides.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("model", "protos", "pod_worker", "controller")
ALLOWED = {
    "model": {"model"},
    "protos": {"protos"},
    "pod_worker": {"model", "protos", "pod_worker"},
    "controller": {"model", "protos", "controller", "pod_worker.schema"},
}


def _our_imports(path: pathlib.Path) -> set[str]:
    """Every multipod module the file imports (at any depth: lazy imports count too), without the
    `multipod.` prefix; a name imported from a package counts as that submodule if it is one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; use multipod.<package> imports")
    ours = set()
    for name in found:
        if name.startswith("multipod."):
            ours.add(name.removeprefix("multipod."))
        elif name.split(".")[0] in PACKAGES:
            raise AssertionError(f"{path}: imports {name} without the multipod namespace")
    return ours


def _allowed(name: str, rules: set[str]) -> bool:
    # "pod_worker.schema.WorkerConfig" is allowed by "pod_worker.schema"; "protos.codec" by "protos".
    return any(name == rule or name.startswith(rule + ".") for rule in rules)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_the_ladder_allows(package):
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _our_imports(path):
            target = name.split(".")[0]
            if target == "cli" or not _allowed(name, ALLOWED[package]):
                violations.append(f"{path.relative_to(ROOT)} imports multipod.{name}")
    assert not violations, "\n".join(violations)


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from multipod.pod_worker.server import start_server\n")
    names = _our_imports(bad)
    assert names == {"pod_worker.server.start_server"}
    assert not _allowed("pod_worker.server.start_server", ALLOWED["controller"])
    assert _allowed("pod_worker.schema.WorkerConfig", ALLOWED["controller"])
    (tmp_path / "bare.py").write_text("import controller\n")
    with pytest.raises(AssertionError, match="without the multipod namespace"):
        _our_imports(tmp_path / "bare.py")


# The controller's subpackages, lowest first: each imports only itself and those before it.
CONTROLLER_LADDER = ("core", "observe", "data", "cluster", "components", "run", "launch", "tune", "commands")


def test_the_controller_is_subpackages_only_each_with_a_map():
    root = ROOT / "controller"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert found == sorted(CONTROLLER_LADDER)
    for package in CONTROLLER_LADDER:
        doc = ast.get_docstring(ast.parse((root / package / "__init__.py").read_text())) or ""
        modules = sorted(p.stem for p in (root / package).glob("*.py") if p.name != "__init__.py")
        missing = [m for m in modules if m not in doc]
        assert not missing, f"controller/{package}/__init__.py does not name {missing} in its map"


@pytest.mark.parametrize("package", CONTROLLER_LADDER)
def test_each_controller_subpackage_imports_only_those_below_it(package):
    allowed = set(CONTROLLER_LADDER[:CONTROLLER_LADDER.index(package) + 1])
    violations = []
    for path in sorted((ROOT / "controller" / package).rglob("*.py")):
        for name in _our_imports(path):
            parts = name.split(".")
            if parts[0] == "controller" and len(parts) > 1 and parts[1] not in allowed:
                violations.append(f"{path.relative_to(ROOT)} imports multipod.{name}")
    assert not violations, "\n".join(violations)


def test_the_controller_reads_configs_without_importing_jax():
    # Every command starts by reading its config; jax and flax cost it a second and a half of
    # imports on this machine, and the controller never computes with them.
    import subprocess
    import sys
    code = ("import sys; import multipod.controller.commands.train, multipod.controller.core.run_config as c; "
            "c.load_config('configs/tiny.toml'); "
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_worker_s_command_line_is_parsed_without_the_controller():
    # `multipod worker` starts once per host of every pod (hundreds of times in a test session):
    # its parser leaves the controller's command modules unimported; other commands see them all.
    import subprocess
    import sys
    code = ("import sys; from multipod.cli import build_parser; "
            "args = build_parser(worker_only=True).parse_args(['worker', '--pod-index', '0']); "
            "print(args.command, any(m.startswith('multipod.controller') for m in sys.modules)); "
            "build_parser().parse_args(['report', 'x']); "
            "print(any(m.startswith('multipod.controller.commands') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["worker", "False", "True"]
