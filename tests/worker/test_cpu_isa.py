"""KILN_CPU_ISA: the process runs as a CPU with less than this one has (engine/config/process_setup.py caps
torch before it loads, engine/worker/cpu_isa.py kiln's kernels at start-up)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config.process_env import CPU_ISA_LEVELS, cpu_isa_limit

ROOT = Path(__file__).resolve().parents[2]


def test_the_limit_is_one_of_the_kernel_levels(monkeypatch):
    from compiler.kernels.cpu_gemv import LEVELS

    assert CPU_ISA_LEVELS == LEVELS
    monkeypatch.delenv("KILN_CPU_ISA", raising=False)
    assert cpu_isa_limit() is None
    for value, want in (("auto", None), (" AVX2 ", "avx2"), ("avx512_vnni", "avx512_vnni")):
        monkeypatch.setenv("KILN_CPU_ISA", value)
        assert cpu_isa_limit() == want
    monkeypatch.setenv("KILN_CPU_ISA", "avx10")
    with pytest.raises(ValueError, match="KILN_CPU_ISA='avx10' is not one of auto, generic, avx2"):
        cpu_isa_limit()


# In a fresh process with KILN_CPU_ISA set: the engine on the tiny Llama, greedy, against transformers.
ENGINE_CODE = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO)
from engine import LLM  # (before torch: the offline API's module prepares the process)
import torch
from compiler.kernels import cpu_gemv
from tests.support.hf_reference import GREEDY, MAX_TOKENS, _prompts, hf_greedy
llm = LLM(sys.argv[1], device="cpu", enforce_eager=True, cpu_quant_activations="float", kv_cache_dtype="float32")
prompts = _prompts(llm.engine.model_config.vocab_size)
outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                  "level": cpu_gemv.LEVELS[cpu_gemv.GEMV.level], "matches": outs == hf_greedy(sys.argv[1],
                  prompts, MAX_TOKENS)}))
"""


def _engine_run(model: Path, limit: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_CPU_ISA": limit, "PYTHONPATH": str(ROOT)}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", ENGINE_CODE, str(model)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction-set levels")
def test_an_avx2_limit_runs_kiln_and_torch_at_avx2_and_matches_transformers(tiny_llama):
    from compiler.kernels.cpu_gemv import GEMV

    if not GEMV.ensure() or 1 not in GEMV.levels:
        pytest.skip("this CPU has no AVX2")
    done = _engine_run(tiny_llama, "avx2")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"capability": "AVX2", "onednn": "AVX2", "level": "avx2", "matches": True}
    assert "KILN_CPU_ISA=avx2: kiln's CPU kernels run at most avx2; torch's at AVX2" in done.stderr


def test_a_bad_limit_is_a_clear_error_at_start_up(tiny_llama):
    done = _engine_run(tiny_llama, "sse9")
    assert done.returncode != 0
    assert "KILN_CPU_ISA='sse9' is not one of auto, generic, avx2, avx2_vnni, avx512, avx512_vnni" in done.stderr
