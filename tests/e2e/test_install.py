"""The installed distribution, used as a user uses it: every package under one `multipod`
namespace, and the wheel's console script trains two pods and generates.

Builds the wheel (no network: --no-build-isolation with this environment's setuptools), installs it
into a fresh virtual environment, and looks from a neutral directory. The fresh environment borrows
this one's dependencies through a plain path entry (which, unlike a site directory, does not run
this environment's editable-install hook), so the multipod it sees is the wheel's.
"""
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import ROOT, TINY


def _run(*cmd, cwd, timeout=300, env=None):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


def _source_packages() -> set[str]:
    """Every package of the source tree, as installed names: each folder with an __init__.py under
    the four top-level packages."""
    found = set()
    for top in ("model", "protos", "pod_worker", "controller"):
        for init in (ROOT / top).rglob("__init__.py"):
            found.add("multipod/" + init.parent.relative_to(ROOT).as_posix())
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel, built as `pip wheel .` builds it, from a copy (setuptools writes build/ and
    *.egg-info beside the sources)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache",
        ".mypy", ".mypy_cache"))
    dist = tmp / "dist"
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source,
                 cwd=tmp)
    assert built.returncode == 0, built.stdout + built.stderr
    return next(dist.glob("multipod-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh virtual environment with the wheel installed (not editable); returns its bin/."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv.parent)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv.parent)
    deps = next(p for p in map(pathlib.Path, sys.path) if p.name == "site-packages" and (p / "jax").is_dir())
    (pathlib.Path(site.stdout.strip()) / "borrowed-dependencies.pth").write_text(f"{deps}\n")
    done = _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel, cwd=venv.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return venv / "bin"


def test_the_wheel_holds_every_package_under_multipod_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"multipod"}
    packages = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    # Every package of the source is in the wheel (the data plane, pod_worker/dcn, was once left
    # out by a hand-written list), and nothing else is: no tests, benchmarks or docs.
    assert packages == _source_packages()
    assert "multipod/pod_worker/dcn/exchange.py" in names
    assert not [n for n in names if n.split("/")[1] in ("tests", "bench", "docs", "examples", "setup.py")]
    assert {"multipod/protos/multipod.proto", "multipod/protos/multipod_pb2.pyi"} <= set(names)


def test_the_installed_wheel_trains_two_pods_and_generates_from_a_neutral_directory(installed, tmp_path, cached_env):
    neutral = tmp_path / "neutral"
    neutral.mkdir()
    python = installed / "python"
    for name in ("model", "controller", "protos", "pod_worker"):
        result = _run(python, "-c", f"import {name}", cwd=neutral)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, (name, result.stderr)
    found = _run(python, "-c", "import multipod.pod_worker.dcn.exchange as x; print(x.__file__)", cwd=neutral)
    assert found.returncode == 0 and found.stdout.startswith(str(installed.parent)), found.stdout + found.stderr
    helped = _run(installed / "multipod", "--help", cwd=neutral)
    assert helped.returncode == 0, helped.stderr
    for command in ("worker", "train", "local", "tune", "peak-flops", "generate", "ptune", "report", "cache"):
        assert command in helped.stdout

    # What a user runs: the console script of the installed wheel, 2 pods on the tiny config,
    # the closing sample and the report included; then generate from the checkpoint it wrote.
    # As in a user's environment, no JAX_COMPILATION_CACHE_DIR: the workers keep their programs
    # in the machine's cache, here a cache root of the test's own that borrows the test session's
    # token caches (so the corpus is not tokenized again).
    env = {k: v for k, v in cached_env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    shared, root = pathlib.Path(cached_env["MULTIPOD_CACHE_DIR"]), tmp_path / "cache"
    root.mkdir()
    for kind in ("tokens", "tokenizers"):
        (shared / kind).mkdir(parents=True, exist_ok=True)
        (root / kind).symlink_to(shared / kind)
    env["MULTIPOD_CACHE_DIR"] = str(root)
    trained = _run(installed / "multipod", "local", "--config", TINY, "--pods", "2", "--devices-per-pod", "1",
                   "--steps", "4", "--run-dir", "run", cwd=neutral, env=env)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "done: 4 steps" in trained.stdout and "sample:" in trained.stdout
    assert (neutral / "run" / "report.png").is_file()
    # The run's programs are in the machine's cache, none in the run directory.
    compiled = root / "jax"
    used = {path.name: path.stat().st_mtime_ns for path in compiled.glob("*-atime")}
    assert any(name.startswith("jit_apply_update-") for name in used), sorted(used)
    assert not (neutral / "run" / ".jax-cache").exists()
    generated = _run(installed / "multipod", "generate", "--checkpoint", "run/checkpoints", "--prompt", "def ",
                     "--max-tokens", "4", "--temperature", "0", cwd=neutral, env=env)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert generated.stdout.startswith("def ") and "4 token(s) in" in generated.stderr
    # generate's worker, a new process, loaded programs the run compiled (jax marks a program
    # read from its cache by rewriting its -atime file).
    assert any(compiled.joinpath(name).stat().st_mtime_ns > then for name, then in used.items())
    listed = _run(installed / "multipod", "cache", "list", cwd=neutral, env=env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert " tokens " in listed.stdout and f"compiled programs {compiled}" in listed.stdout, listed.stdout


def test_building_the_command_line_imports_no_jax():
    """`multipod worker` must set its simulated devices before jax starts, and --help must be quick:
    parsing any command but tune's --remat leaves jax unimported."""
    code = ("import sys, multipod.cli as c; p = c.build_parser(); "
            "[p.parse_args(a) for a in (['worker', '--pod-index', '0'], ['train', '--workers', 'x:1'], "
            "['local'], ['tune'], ['peak-flops'], ['cache', 'list'])]; print('jax' in sys.modules)")
    result = _run(sys.executable, "-c", code, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stdout + result.stderr
