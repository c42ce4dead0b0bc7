"""tools/gpu_summary.py (the GPU check's bookkeeping) as a module, for the tests that drive it and
read what it records (tests/house/test_gpu_check.py, test_gpu_summary.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_summary = _load("gpu_summary")
