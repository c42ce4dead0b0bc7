"""Context length vs the KV budget: the largest context that fits when none is asked for, a clear
error naming the device's budget setting when an explicit one does not fit."""

from __future__ import annotations

import logging

import pytest

from engine.core.kv.kv_sizing import blocks_from_budget, budget_setting, fit_max_model_len, tokens_per_sequence

BLOCK = 1024 * 16  # bytes per block in these examples


def test_full_context_is_kept_when_it_fits():
    assert fit_max_model_len(None, 1000, 64, 16, BLOCK, "cpu", False) == 1000
    assert fit_max_model_len(512, 1000, 64, 16, BLOCK, "cpu", False) == 512
    assert tokens_per_sequence(64, 16) == 1008


def test_unset_context_shrinks_to_whole_blocks_that_fit(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.core.kv.kv_sizing"):
        got = fit_max_model_len(None, 8192, 364, 16, BLOCK, "cpu", False)
    assert got == 363 * 16 and got % 16 == 0
    assert "serving a context of 5808 tokens" in caplog.text and "kv_cache_memory_gb" in caplog.text


def test_explicit_context_that_does_not_fit_names_the_device_setting():
    with pytest.raises(ValueError, match="kv_cache_memory_gb to at least") as cpu:
        fit_max_model_len(8192, 8192, 364, 16, BLOCK, "cpu", False)
    assert "gpu_memory_utilization" not in str(cpu.value)
    with pytest.raises(ValueError, match="raise gpu_memory_utilization") as gpu:
        fit_max_model_len(8192, 8192, 364, 16, BLOCK, "cuda", False)
    assert "kv_cache_memory_gb" not in str(gpu.value)
    with pytest.raises(ValueError, match="num_gpu_blocks to at least 512"):
        fit_max_model_len(8192, 8192, 364, 16, BLOCK, "cpu", True)


def test_the_suggested_cpu_budget_is_enough():
    import re

    with pytest.raises(ValueError) as err:
        fit_max_model_len(8192, 8192, 364, 16, BLOCK, "cpu", False)
    gb = float(re.search(r"at least ([0-9.]+)", str(err.value)).group(1))
    blocks = blocks_from_budget(gb * (1 << 30), BLOCK, "cpu")
    assert fit_max_model_len(8192, 8192, blocks, 16, BLOCK, "cpu", False) == 8192


def test_budget_too_small_for_two_blocks():
    with pytest.raises(ValueError, match="raise kv_cache_memory_gb"):
        blocks_from_budget(BLOCK * 1.5, BLOCK, "cpu")
    assert budget_setting("cuda", False) == "gpu_memory_utilization"


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny llama whose full context (2**18 positions x 2 KiB of KV per token: four layers) is
    twice the default CPU KV budget (0.25 GiB). Same attention layout as tiny_llama, so the CPU
    attention kernel built for it is reused."""
    from engine.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("long-ctx"), overrides=dict(
        max_position_embeddings=1 << 18, num_hidden_layers=4))


def test_llm_starts_with_defaults_on_a_model_whose_context_does_not_fit(long_context_model, caplog):
    from engine.core.request import SamplingParams
    from engine.entrypoints.llm import LLM

    with caplog.at_level(logging.INFO):
        llm = LLM(str(long_context_model), device="cpu", enforce_eager=True)
    engine = llm.engine
    assert engine.max_model_len == engine.pool.num_usable * engine.settings.block_size < 1 << 18
    assert f"serving a context of {engine.max_model_len} tokens" in caplog.text
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="kv_cache_memory_gb to at least 0.50"):
        LLM(str(long_context_model), device="cpu", enforce_eager=True, max_model_len=1 << 18)


def test_kiln_serve_starts_with_defaults_and_logs_the_context(long_context_model, tmp_path):
    """`kiln serve --model DIR` with default settings (compiled CPU path included) on that model."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    root = Path(__file__).resolve().parents[1]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.entrypoints.cli", "serve", "--model", str(long_context_model),
                                 "--port", "0"], cwd=root, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        deadline = time.monotonic() + 600
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("kiln: serving"):
                url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        assert url is not None, log_path.read_text()[-3000:]
        text = log_path.read_text()
        assert "serving a context of" in text and "max_model_len" in text, text[-3000:]
        body = {"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
