"""The package list, found rather than written by hand (pyproject.toml holds everything else).

The repository root is the `multipod` package (pyproject's package-dir), so setuptools' own
find_packages lists the subpackages and each gets the `multipod.` prefix: a new subpackage lands in
the wheel without anyone remembering to add it. tests/, bench/, docs/ and examples/ stay out, and
so does this file (it sits in the root package's folder, but it is not part of the package).
"""
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_INSTALLED = ["tests", "tests.*", "bench", "bench.*", "docs", "docs.*", "examples", "examples.*", "build*"]


class BuildPy(build_py):
    """build_py without the build script itself in the root package."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "multipod" and m[1] == "setup")]


setup(packages=["multipod"] + [f"multipod.{name}" for name in find_packages(exclude=NOT_INSTALLED)],
      cmdclass={"build_py": BuildPy})
