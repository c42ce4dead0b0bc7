"""Swap: swap_blocks / BlockSwapper on tensors, the engine preempting by swap, warm prefixes."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from engine.core.params import SamplingParams
from engine.runtime.warm_prefixes import WarmPrefixError, load_warm_prefixes
from engine.worker.block_swapper import BlockSwapper, _runs, block_major, swap_blocks


def _cache(num_blocks=12, layers=2, bs=4, heads=2, dim=8, dtype=torch.float32, device="cpu"):
    return torch.randn(layers, 2, num_blocks, bs, heads, dim, dtype=dtype, device=device)


def test_runs_coalesce_consecutive_ids():
    assert _runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert _runs([7]) == [(0, 7, 1)]


@pytest.mark.parametrize("staging_blocks", [1, 3, 16])
def test_swap_blocks_round_trip_on_cpu(staging_blocks):
    cache = _cache()
    orig = cache.clone()
    gpu = block_major(cache)
    pool = torch.zeros(10, *gpu.shape[1:])
    staging = torch.empty(staging_blocks, *gpu.shape[1:])
    out_map = [(5, 2), (6, 3), (1, 7), (11, 0), (2, 9)]
    moved = swap_blocks(gpu, pool, out_map, staging)
    assert moved == len(out_map) * gpu[0].numel() * 4
    for g, c in out_map:
        assert torch.equal(pool[c], orig[:, :, g])
    # Back into other GPU blocks.
    in_map = [(2, 8), (3, 4), (7, 10), (0, 3), (9, 6)]
    swap_blocks(pool, gpu, in_map, staging)
    for (g, c), (_, dst) in zip(out_map, in_map):
        assert torch.equal(cache[:, :, dst], orig[:, :, g])
    untouched = [b for b in range(12) if b not in {d for _, d in in_map}]
    assert torch.equal(cache[:, :, untouched], orig[:, :, untouched])
    assert swap_blocks(gpu, pool, [], staging) == 0


def test_block_swapper_on_cpu_counts_bytes():
    cache = _cache(dtype=torch.bfloat16)
    orig = cache.clone()
    swapper = BlockSwapper(cache, num_cpu_blocks=6, staging_bytes=1)
    assert swapper.staging.shape[0] == 1 and not swapper.cpu.is_pinned()
    assert swapper.measurement() is None
    swapper.launch([(3, 0), (4, 1)], [])
    swapper.wait()
    moved, seconds = swapper.measurement()  # for auto preemption's cost model, read once
    assert moved == 2 * swapper.bytes_per_block and seconds > 0 and swapper.measurement() is None
    cache[:, :, 3:5] = 0
    swapper.launch([], [(0, 7), (1, 8)])
    swapper.wait()
    assert torch.equal(cache[:, :, 7:9], orig[:, :, 3:5])
    assert swapper.bytes_out == swapper.bytes_in == 2 * swapper.bytes_per_block


@pytest.mark.gpu
def test_block_swapper_orders_copies_against_the_compute_stream():
    """A step that overwrites a block right after its swap-out is queued must not corrupt the copy."""
    torch.manual_seed(0)
    cache = _cache(num_blocks=600, layers=4, bs=16, heads=8, dim=128, dtype=torch.bfloat16, device="cuda")
    orig = cache.clone()
    swapper = BlockSwapper(cache, num_cpu_blocks=520, staging_bytes=64 << 20)
    assert swapper.cpu.is_pinned()
    src = random.Random(0).sample(range(1, 600), 512)
    swapper.launch([(g, c) for c, g in enumerate(src)], [])
    swapper.wait()
    cache.zero_()  # the "forward" writes into the blocks just freed
    swapper.launch([], [(c, g) for c, g in enumerate(src)])
    swapper.wait()
    torch.cuda.synchronize()
    assert torch.equal(cache[:, :, src], orig[:, :, src])
    moved, seconds = swapper.measurement()  # the swap-in, timed by CUDA events
    assert moved == 512 * swapper.bytes_per_block and seconds > 0 and swapper.measurement() is None


# ---- the engine preempting by swap ----


def _greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(6, 30))] for _ in range(n)]


# overlap: a GPU's defaults (overlap scheduling, the compiled attention), as the engine runs there
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_engine_swap_matches_unconstrained_greedy(make_llm, mode, overlap, caplog):
    prompts = _prompts(12)
    ref = make_llm(max_num_seqs=16, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, _greedy(24), use_tqdm=False)]
    llm = make_llm(
        max_num_seqs=8,
        max_model_len=64,
        block_size=8,
        num_gpu_blocks=14,
        preemption_mode=mode,
        swap_space_gb=0.01,
        max_num_batched_tokens=64,
        async_scheduling=overlap,
        enforce_eager=not overlap,
    )
    with caplog.at_level(logging.INFO, logger="engine.core.sched.scheduler"):
        outs = llm.generate(prompts, _greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    eng = llm.engine
    by_mode = eng.core.scheduler.preemptions_by_mode
    assert by_mode["swap"] > 0
    assert sum(o.outputs[0].num_preemptions for o in outs) == eng.core.scheduler.num_preemptions
    space = eng.core.swap_space
    assert space.bytes_out == eng.core.block_swapper.bytes_out > 0 and space.bytes_in == eng.core.block_swapper.bytes_in
    assert space.bytes_out == space.bytes_in + space.blocks_reused * space.bytes_per_block
    assert eng.core.swap_space.is_fully_free() and eng.core.is_idle_and_free()
    logged = [r.getMessage() for r in caplog.records if "preempted request" in r.getMessage()]
    assert len(logged) == eng.core.scheduler.num_preemptions
    assert any(" by swap: out of KV blocks" in m and "offline-" in m for m in logged)


def test_engine_without_swap_space_recomputes(make_llm):
    llm = make_llm(
        max_num_seqs=8,
        max_model_len=64,
        block_size=8,
        num_gpu_blocks=14,
        preemption_mode="swap",
        swap_space_gb=0.0,
        max_num_batched_tokens=64,
    )
    assert llm.engine.core.swap_space is None
    llm.generate(_prompts(8), _greedy(24), use_tqdm=False)
    assert llm.engine.core.scheduler.preemptions_by_mode == {
        "recompute": llm.engine.core.scheduler.num_preemptions,
        "swap": 0,
    }


# ---- warm prefixes ----


def test_load_warm_prefixes_formats(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    lines = tmp_path / "p.txt"
    lines.write_text("You are a helpful assistant.\n\nAnswer briefly.\n")
    assert load_warm_prefixes(lines, tok) == [tok.encode("You are a helpful assistant."), tok.encode("Answer briefly.")]
    chat = [{"role": "system", "content": "You are kiln."}]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["plain prompt", [5, 6, 7], chat]))
    got = load_warm_prefixes(js, tok)
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    assert got == [tok.encode("plain prompt"), [5, 6, 7], tok.encode(rendered, add_special_tokens=False)]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"role": 1}]')
    with pytest.raises(WarmPrefixError, match="item 0"):
        load_warm_prefixes(bad, tok)
    with pytest.raises(WarmPrefixError, match="cannot read"):
        load_warm_prefixes(tmp_path / "missing.txt", tok)


def test_warm_prefixes_are_pinned_and_survive_pressure(make_llm):
    llm = make_llm(max_num_seqs=4, max_model_len=128, block_size=8, num_gpu_blocks=20, max_num_batched_tokens=64)
    eng = llm.engine
    prefix = list(range(10, 43))  # 33 tokens: 4 full blocks
    assert eng.warm_prefixes([prefix, prefix[:16], [1, 2]]) == 4  # shared blocks pinned once; short one skipped
    assert eng.core.pool.num_pinned == 4 and eng.core.is_idle_and_free()
    # Pressure: many distinct prompts cycle through the rest of the pool (evicting cached blocks).
    llm.generate(_prompts(16, seed=3), _greedy(12), use_tqdm=False)
    blocks, _ = eng.core.pool.match_prefix(prefix, 4)
    assert len(blocks) == 4, "a pinned block was evicted"
    out = llm.generate([prefix + [7, 8, 9]], _greedy(4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    ref = make_llm(max_num_seqs=4, max_model_len=128, enable_prefix_caching=False)
    assert (
        ref.generate([prefix + [7, 8, 9]], _greedy(4), use_tqdm=False)[0].outputs[0].token_ids
        == out.outputs[0].token_ids
    )
    eng.core.check_integrity()


def test_swap_bench_runs_on_cpu(capsys):
    from engine.bench.swap import main

    assert main(["--device", "cpu", "--blocks", "1,6", "--iters", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["correct"] and [r["blocks"] for r in summary["results"]] == [1, 6, 6]
    assert all(r["swap_out_gbps"] > 0 and r["pinned_h2d_gbps"] > 0 for r in summary["results"])
