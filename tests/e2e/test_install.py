"""The installed distribution: everything under one `multipod` namespace, the console script works.

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

from tests.helpers import ROOT


def _run(*cmd, cwd, timeout=300):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_the_wheel_exposes_only_the_multipod_namespace(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache"))
    dist = tmp_path / "dist"
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source,
                 cwd=tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next(dist.glob("multipod-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"multipod"}

    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).stdout.strip()
    deps = next(p for p in map(pathlib.Path, sys.path) if p.name == "site-packages" and (p / "jax").is_dir())
    (pathlib.Path(site) / "borrowed-dependencies.pth").write_text(f"{deps}\n")
    installed = _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    neutral = tmp_path / "neutral"
    neutral.mkdir()
    for name in ("model", "controller", "protos", "pod_worker"):
        result = _run(python, "-c", f"import {name}", cwd=neutral)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, (name, result.stderr)
    found = _run(python, "-c", "import multipod.model, multipod.controller.run.training as t; print(t.__file__)",
                 cwd=neutral)
    assert found.returncode == 0 and found.stdout.startswith(str(venv)), found.stdout + found.stderr
    helped = _run(venv / "bin" / "multipod", "--help", cwd=neutral)
    assert helped.returncode == 0, helped.stderr
    for command in ("worker", "train", "local", "tune", "peak-flops"):
        assert command in helped.stdout


def test_building_the_command_line_imports_no_jax():
    """`multipod worker` must set its simulated devices before jax starts, and --help must be quick:
    parsing any command but tune's --remat leaves jax unimported."""
    code = ("import sys, multipod.cli as c; p = c.build_parser(); "
            "[p.parse_args(a) for a in (['worker', '--pod-index', '0'], ['train', '--workers', 'x:1'], "
            "['local'], ['tune'], ['peak-flops'])]; print('jax' in sys.modules)")
    result = _run(sys.executable, "-c", code, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stdout + result.stderr
