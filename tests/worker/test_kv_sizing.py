"""Context length vs the KV budget: the largest context that fits when none is asked for, a clear
error naming the device's budget setting when an explicit one does not fit. The CPU's default
budget: a share of the memory actually free, capped by what the sequences can use."""

from __future__ import annotations

import logging

import pytest

from engine.worker.kv_sizing import (
    CPU_HEADROOM,
    CPU_KV_FLOOR,
    GIB,
    activation_bytes,
    blocks_from_budget,
    budget_setting,
    cgroup_headroom,
    cpu_kv_budget,
    fit_max_model_len,
    parse_meminfo,
    read_free_memory,
    tokens_per_sequence,
)

BLOCK = 1024 * 16  # bytes per block in these examples


def test_full_context_is_kept_when_it_fits():
    assert fit_max_model_len(None, 1000, 64, 16, BLOCK, "cpu", False) == 1000
    assert fit_max_model_len(512, 1000, 64, 16, BLOCK, "cpu", False) == 512
    assert tokens_per_sequence(64, 16) == 1008


def test_unset_context_shrinks_to_whole_blocks_that_fit(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.worker.kv_sizing"):
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
    twice a CPU KV budget of 0.25 GiB with a float32 cache (the tests pin it: the CPU default is
    float16, half of that). Same attention layout as tiny_llama, so the CPU attention kernel built
    for it is reused."""
    from engine.models.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("long-ctx"), overrides=dict(max_position_embeddings=1 << 18, num_hidden_layers=4)
    )


def test_llm_starts_with_defaults_on_a_model_whose_context_does_not_fit(long_context_model, caplog):
    from engine.core.params import SamplingParams
    from engine.entrypoints.llm import LLM

    with caplog.at_level(logging.INFO):
        llm = LLM(
            str(long_context_model), device="cpu", enforce_eager=True, kv_cache_memory_gb=0.25, kv_cache_dtype="float32"
        )
    engine = llm.engine
    assert engine.max_model_len == engine.core.pool.num_usable * engine.settings.block_size < 1 << 18
    assert f"serving a context of {engine.max_model_len} tokens" in caplog.text
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="kv_cache_memory_gb to at least 0.50"):
        LLM(
            str(long_context_model),
            device="cpu",
            enforce_eager=True,
            max_model_len=1 << 18,
            kv_cache_memory_gb=0.25,
            kv_cache_dtype="float32",
        )


def test_kiln_serve_starts_with_defaults_and_logs_the_context(long_context_model, tmp_path):
    """`kiln serve --model DIR` with default settings (compiled CPU path included) on that model, its
    KV cache held to 0.25 GiB."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    root = Path(__file__).resolve().parents[2]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.entrypoints.cli",
                "serve",
                "--model",
                str(long_context_model),
                "--port",
                "0",
                "--kv-cache-memory-gb",
                "0.25",
                "--kv-cache-dtype",
                "float32",
            ],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
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


# ---- the CPU's default budget ---------------------------------------------------------------------
MEMINFO = "MemTotal:       24684092 kB\nMemFree:        13444620 kB\nMemAvailable:   19346984 kB\n"


def test_meminfo_and_cgroup_parsing():
    assert parse_meminfo(MEMINFO) == 19346984 * 1024
    assert parse_meminfo("MemTotal: 1 kB\n") is None
    assert cgroup_headroom(None, 5) is None
    assert cgroup_headroom(9223372036854771712, 5 * GIB) is None  # cgroup v1's "no limit"
    assert cgroup_headroom(8 * GIB, 5 * GIB) == 3 * GIB
    assert cgroup_headroom(8 * GIB, 5 * GIB, inactive_file=1 * GIB) == 4 * GIB  # reclaimable page cache
    assert cgroup_headroom(8 * GIB, 9 * GIB) == 0


def test_cpu_budget_is_a_share_of_what_is_free():
    free, act = 19 * GIB, GIB // 2
    budget, why = cpu_kv_budget(free, act, needed_bytes=100 * GIB)
    assert budget == int((free - act - CPU_HEADROOM) * 0.5)
    assert "50% of the 19.0 GiB free" in why
    # split over tensor-parallel ranks: each rank gets its part
    assert cpu_kv_budget(free, act, 100 * GIB, ranks=2)[0] == budget // 2


def test_cpu_budget_stops_at_what_the_sequences_can_use():
    budget, why = cpu_kv_budget(19 * GIB, 0, needed_bytes=3 * GIB)
    assert budget == 3 * GIB and "every sequence at the full context" in why


def test_cpu_budget_floor_when_memory_is_short():
    budget, why = cpu_kv_budget(GIB, GIB // 2, needed_bytes=100 * GIB)
    assert budget == CPU_KV_FLOOR and "memory is short" in why
    assert cpu_kv_budget(GIB, GIB // 2, needed_bytes=1000)[0] == 1000  # never above the need


def test_smollm2_on_a_24_gb_machine_gets_its_full_context():
    """The issue's case: SmolLM2-135M (30 layers, 3 KV heads of 64, float32: 720 KiB per 16-token
    block) with 18 GiB free: far more than the 363 blocks of the old 0.25 GiB default, and the
    model's whole 8192-token context for every one of dozens of sequences."""
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    needed = (64 * 8192 // 16 + 1) * per_block
    act = activation_bytes(2048, 64, 576, 1536, (9 + 6) * 64, 49152, 4)
    budget, _ = cpu_kv_budget(18 * GIB, act, needed)
    blocks = blocks_from_budget(budget, per_block, "cpu")
    assert blocks > 10_000 and fit_max_model_len(None, 8192, blocks, 16, per_block, "cpu", False) == 8192


def test_free_memory_reads_this_machine():
    free = read_free_memory()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    assert free.bytes > 0 and free.source


def test_engine_default_budget_is_logged_and_fits_the_need(make_llm, caplog):
    """Default settings on the tiny llama: the cache holds every sequence at the full context
    (64 x 1024 tokens, far below half the free memory) and the start-up log says so."""
    with caplog.at_level(logging.INFO, logger="engine.worker.kv_sizing"):
        llm = make_llm()
    engine = llm.engine
    s = engine.settings
    assert engine.core.kv_cache.num_blocks == s.max_num_seqs * (engine.max_model_len // s.block_size) + 1
    assert "KV cache on the CPU" in caplog.text and "every sequence at the full context" in caplog.text
    explicit = make_llm(kv_cache_memory_gb=0.01)
    # (2-byte elements: the CPU's default cache for a float32 model is float16)
    assert explicit.engine.core.kv_cache.num_blocks == int(0.01 * GIB) // (2 * 2 * 16 * 2 * 32 * 2)


KV_BY_USE = r"""
import json, sys
from engine import LLM, SamplingParams

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

llm = LLM(sys.argv[1], device="cpu", enforce_eager=True, num_gpu_blocks=int(sys.argv[2]), max_num_seqs=4,
          max_model_len=256, cpu_quant_activations="float")
built = rss()
params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
for round in range(6):  # several workloads: freed blocks are reused lowest-first, not the next untouched ones
    llm.generate([f"prompt {round} {i} " * 8 for i in range(4)], params, use_tqdm=False)
pool = llm.engine.core.pool
print(json.dumps({"built": built, "after": rss(), "kv_bytes": llm.engine.core.kv_cache.tensor.nbytes,
                  "highest_block": max(pool._idle, default=0)}))
"""


def test_kv_memory_follows_use_not_the_reservation(tiny_llama, tmp_path):
    """A reservation of ~1.5 GB is not touched at start, and a workload holding a few hundred
    tokens at a time leaves the resident KV at what it held (lowest blocks reused), not the whole."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}

    def run(blocks: int) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", KV_BY_USE, str(tiny_llama), str(blocks)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    small, large = run(512), run(200_000)
    assert large["kv_bytes"] > 1_000_000_000 > 50 * small["kv_bytes"]
    # Resident memory: within 100 MB of the small reservation's, at start and after the workload.
    assert large["built"] - small["built"] < 100 << 20, (small, large)
    assert large["after"] - small["after"] < 100 << 20, (small, large)
    assert large["highest_block"] < 1000, large  # the blocks used stay at the bottom of the pool


def _resident_bytes(start: int, nbytes: int) -> int | None:
    """Resident bytes of the mappings over [start, start + nbytes) (Linux /proc/self/smaps; None
    elsewhere). Several mappings: an madvise over part of one splits it."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside, total = False, 0
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < start + nbytes and hi > start
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_kv_blocks_become_resident_one_at_a_time():
    """The CPU cache is reserved untouched, and writing one block of every layer makes about those
    blocks resident, not the 2 MB huge page around each: numpy's zeros (the cache's allocation before)
    advised huge pages, and SmolLM2's first token made its whole cache resident (30 layers' K and V,
    2 MB each)."""
    import torch

    from engine.layers.kv_cache import KVCache

    kv = KVCache(30, 512, 16, 3, 64, torch.float16, torch.device("cpu"))  # SmolLM2's layout: 189 MB
    span = (kv.tensor.data_ptr(), kv.tensor.nbytes)
    if _resident_bytes(*span) is None:
        pytest.skip("needs /proc/self/smaps")
    assert _resident_bytes(*span) < 1 << 20  # (reserved, not touched)
    kv.tensor[:, :, 1] = 1.0  # block 1 of every layer's K and V: 60 x 6 KB
    assert _resident_bytes(*span) < 4 << 20, "a written block took more than its own pages"
    assert kv.tensor[:, :, 1].eq(1).all() and kv.tensor[:, :, 2].eq(0).all()
