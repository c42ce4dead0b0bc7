"""Process-level settings (engine/config/process_setup.py): importing kiln changes nothing in the process;
prepare_process(), called by each entry point before torch loads, applies the OpenMP spin and the
KILN_CPU_ISA caps once and records them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config.process_env import TORCH_ISA_VARIABLES
from engine.config.process_setup import QUIET_SPIN_COUNT, SHARED_SPIN_COUNT

ROOT = Path(__file__).resolve().parents[2]

# Counts the opens of /proc/stat (the CPU probe) and keeps the environment as it was at start.
PRELUDE = """
import json, os, sys
ENV = dict(os.environ)
PROBES = []
sys.addaudithook(lambda event, args: PROBES.append(1) if event == "open" and args[0] == "/proc/stat" else None)
def report(**extra):
    from engine.config.process_setup import current_setup
    setup = current_setup()
    changed = sorted(k for k in set(ENV) | set(os.environ) if ENV.get(k) != os.environ.get(k))
    print(json.dumps({"changed": changed, "torch": "torch" in sys.modules, "probes": len(PROBES),
                      "setup": None if setup is None else {"before_torch": setup.before_torch,
                                                           "cpu_isa": setup.cpu_isa, "wait": setup.wait_policy()},
                      **extra}))
"""


def _run(code: str, **env_extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KILN_CPU_ISA", *TORCH_ISA_VARIABLES)
    }
    env.update(env_extra, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_kiln_changes_nothing():
    got = _run("import engine, engine.core, engine.config\nengine.SamplingParams\nreport()", KILN_CPU_ISA="avx2")
    assert got == {"changed": [], "torch": False, "probes": 0, "setup": None}


def test_prepare_process_applies_the_spin_and_the_isa_limit_once():
    got = _run(
        "from engine.config.process_setup import prepare_process\n"
        "first = prepare_process()\n"
        "report(same=prepare_process() is first, torch_isa=first.torch_isa)",
        KILN_CPU_ISA="avx2",
    )
    assert got["setup"]["before_torch"] and got["setup"]["cpu_isa"] == "avx2" and got["same"]
    assert got["probes"] == 2  # (one look at the cores' load: /proc/stat before and after)
    assert got["changed"] == sorted(["GOMP_SPINCOUNT", *TORCH_ISA_VARIABLES])
    assert got["torch_isa"] == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert got["setup"]["wait"].split(" (")[0] in (
        f"spin {n} then sleep" for n in (QUIET_SPIN_COUNT, SHARED_SPIN_COUNT)
    )


def test_after_torch_it_records_that_and_changes_nothing():
    got = _run(
        "import torch\nfrom engine.config.process_setup import prepare_process\nprepare_process()\nreport()",
        KILN_CPU_ISA="avx2",
    )
    assert got["changed"] == [] and got["probes"] == 0
    assert got["setup"]["before_torch"] is False and got["setup"]["cpu_isa"] == "avx2"
    assert "imported before kiln" in got["setup"]["wait"]


@pytest.mark.parametrize(
    "entry",
    [
        "import engine.entrypoints.llm",  # (`from engine import LLM`)
        "from engine.entrypoints.cli.main import main\nmain(['bench'])",  # (`kiln ...`: bench prints its list)
        "import engine.executor.tp_worker",  # (a tensor-parallel worker process's first import)
        "import engine.bench.latency",  # (`python -m engine.bench.latency`)
    ],
)
def test_each_entry_point_prepares_the_process_before_torch(entry):
    got = _run(f"{entry}\nreport()", KILN_CPU_ISA="avx2")
    assert got["setup"] is not None and got["setup"]["before_torch"], got
    assert {"GOMP_SPINCOUNT", "ATEN_CPU_CAPABILITY"} <= set(got["changed"])
