"""setuptools' build hook (metadata is in pyproject.toml): a wheel ships kiln's C++ CPU kernels for
every ISA level when torch is importable where it builds (compiler/kernels/wheel_build.py)."""

import importlib.util
from pathlib import Path

from setuptools import setup

# Loaded by path: the build environment may lack torch and kiln's dependencies.
_spec = importlib.util.spec_from_file_location(
    "kiln_wheel_build", Path(__file__).resolve().parent / "compiler" / "kernels" / "wheel_build.py"
)
assert _spec is not None and _spec.loader is not None
wheel_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheel_build)

setup(cmdclass=wheel_build.cmdclass())
