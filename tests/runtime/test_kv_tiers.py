"""KV tiers in the engine: greedy tokens with tier hits equal a recompute's, token for token —
after eviction, after a restart, across two engines on one directory, with an fp8 cache, with a
LoRA adapter, under preemption by swap — and damaged files or a changed model are recomputed."""

from __future__ import annotations

import shutil

import pytest

from engine import LoRARequest, SamplingParams
from tests.support.kv_tiers import BS, SMALL, prompt, run, tier_stats


def flush(llm):
    llm.engine.core.kv_tiers.flush()


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    """A private copy of the tiny model (one test rewrites its weights in place)."""
    return shutil.copytree(tiny_llama, tmp_path_factory.mktemp("kv-tiers") / "model")


@pytest.fixture(scope="module")
def reference(model):
    """Tokens of a plain engine (no tiers), by prompt seed."""
    from engine.entrypoints.llm import LLM

    llm = LLM(str(model), device="cpu", enforce_eager=True, **SMALL)
    tokens, _ = run(llm, [prompt(s) for s in range(4)])
    return dict(enumerate(tokens))


def test_off_by_default(make_llm, model):
    assert make_llm(model, **SMALL).engine.core.kv_tiers is None


def test_evicted_prefix_comes_back_from_disk_equal(make_llm, model, reference, tmp_path):
    llm = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    assert run(llm, [prompt(0)])[0] == [reference[0]]
    assert run(llm, [prompt(1)])[0] == [reference[1]]  # evicts prompt 0's blocks
    flush(llm)
    tokens, cached = run(llm, [prompt(0)])
    counters, stats = tier_stats(llm)
    assert tokens == [reference[0]]
    assert cached[0] == 144 and counters.blocks_loaded >= 1 and stats["disk"].hits >= 1
    assert llm.engine.core.pool.counters.evictions > 0
    # /metrics shows the tier's work.
    from engine.entrypoints.openai.metrics import EngineMetrics

    metrics = EngineMetrics("m", log_stats_interval=0)
    metrics.on_step(llm.engine, [], 0.0)
    text = metrics.render().decode()
    assert f'kiln:kv_tier_hits_total{{model_name="m",tier="disk"}} {float(stats["disk"].hits)}' in text
    assert f'kiln:kv_tier_blocks_loaded_total{{model_name="m"}} {float(counters.blocks_loaded)}' in text
    assert 'kiln:kv_tier_hits_total{model_name="m",tier="remote"} 0.0' in text


def test_restart_and_a_second_engine_on_the_same_directory(make_llm, model, reference, tmp_path):
    first = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    second = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)  # started before first wrote anything
    assert run(first, [prompt(2)])[0] == [reference[2]]
    flush(first)
    tokens, cached = run(second, [prompt(2)])
    assert tokens == [reference[2]] and cached == [144]
    first.close()
    restarted = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    tokens, cached = run(restarted, [prompt(2)])
    assert tokens == [reference[2]] and cached == [144]
    assert tier_stats(restarted)[1]["disk"].hits == 9


def test_damaged_files_are_recomputed_not_served(make_llm, model, reference, tmp_path):
    first = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    run(first, [prompt(3)])
    first.close()
    files = sorted(p for p in tmp_path.rglob("*.kvb"))
    assert len(files) == 9
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0x40  # a flipped bit
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:-100])  # truncated
    files[2].write_bytes(files[3].read_bytes())  # another block's record
    llm = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    tokens, cached = run(llm, [prompt(3)])
    assert tokens == [reference[3]]
    counters, stats = tier_stats(llm)
    assert not files[1].exists()  # (dropped at start: partial)
    # Whatever chain position the damaged files held, the run of loaded blocks stops at the first.
    assert cached[0] < 144 and stats["disk"].hits == cached[0] // BS


def test_the_check_can_fail(make_llm, model, reference, tmp_path, monkeypatch):
    """Served wrong KV shows in the tokens: the equality checks above can fail."""
    first = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    run(first, [prompt(0)])
    first.close()
    llm = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    io = llm.engine.core.kv_tiers.io
    write = io.write
    monkeypatch.setattr(io, "write", lambda ids, payloads: write(ids, [bytes(len(p)) for p in payloads]))
    tokens, cached = run(llm, [prompt(0)])
    assert cached == [144] and tokens != [reference[0]]


def test_a_model_changed_in_place_never_reuses_old_kv(make_llm, tiny_llama, tmp_path):
    from engine.models.tiny_model import make_tiny_model

    model = shutil.copytree(tiny_llama, tmp_path / "model")
    first = make_llm(model, kv_disk_path=str(tmp_path / "kv"), **SMALL)
    run(first, [prompt(0)])
    first.close()
    make_tiny_model(model, arch="llama", seed=99)  # other weights, same path and shapes
    changed = make_llm(model, kv_disk_path=str(tmp_path / "kv"), **SMALL)
    _, cached = run(changed, [prompt(0)])
    assert cached == [0] and tier_stats(changed)[0].requests_held == 0
    assert len(list((tmp_path / "kv").iterdir())) == 2  # two fingerprints, two namespaces


def test_fp8_cache_restart_equal_and_scales_in_the_key(make_llm, model, tmp_path):
    fp8 = dict(SMALL, kv_cache_dtype="fp8", dtype="bfloat16")
    plain = make_llm(model, **fp8)
    want, _ = run(plain, [prompt(0)])
    first = make_llm(model, kv_disk_path=str(tmp_path), **fp8)
    assert run(first, [prompt(0)])[0] == want
    first.close()
    again = make_llm(model, kv_disk_path=str(tmp_path), **fp8)
    tokens, cached = run(again, [prompt(0)])
    assert tokens == want and cached == [144]
    import torch

    from engine.runtime.kv_tiers_setup import kv_fingerprint

    core = again.engine.core
    fp = kv_fingerprint(again.settings, model, core.kv_cache.tensor, core.kv_cache.scales, core.dtype, core.device)
    other = kv_fingerprint(
        again.settings, model, core.kv_cache.tensor, core.kv_cache.scales * 2, core.dtype, core.device
    )
    assert fp == core.kv_tiers.store.fingerprint and other != fp
    assert core.kv_cache.tensor.dtype == torch.float8_e4m3fn


def test_lora_prefixes_keyed_by_the_adapter(make_llm, model, tmp_path):
    from tests.support.lora import _make_adapter

    a = _make_adapter(model, tmp_path / "a", ["q_proj", "v_proj"], 4, 1)
    b = _make_adapter(model, tmp_path / "b", ["q_proj", "v_proj"], 4, 2)
    lora = dict(SMALL, enable_lora=True, max_loras=2, max_lora_rank=8)
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    plain = make_llm(model, **lora)
    want_a, _ = run(plain, [prompt(1)], lora_request=ra)
    want_b, _ = run(plain, [prompt(1)], lora_request=rb)
    assert want_a != want_b
    first = make_llm(model, kv_disk_path=str(tmp_path / "kv"), **lora)
    run(first, [prompt(1)], lora_request=ra)
    first.close()
    again = make_llm(model, kv_disk_path=str(tmp_path / "kv"), **lora)
    tokens, cached = run(again, [prompt(1)], lora_request=rb)  # adapter b: a's KV is not its own
    assert tokens == want_b and cached == [0]
    tokens, cached = run(again, [prompt(1)], lora_request=ra)
    assert tokens == want_a and cached == [144]


def test_under_preemption_by_swap_equal(make_llm, model, reference, tmp_path):
    tight = dict(SMALL, num_gpu_blocks=30, preemption_mode="swap", swap_space_gb=0.01)
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = make_llm(model, **tight)
    want, _ = run(plain, [prompt(s, 100) for s in range(4)], params)
    llm = make_llm(model, kv_disk_path=str(tmp_path), **tight)
    assert run(llm, [prompt(s, 100) for s in range(4)], params)[0] == want
    assert llm.engine.core.scheduler.num_preemptions > 0
    flush(llm)
    again = make_llm(model, kv_disk_path=str(tmp_path), **tight)
    tokens, cached = run(again, [prompt(s, 100) for s in range(4)], params)
    assert tokens == want and sum(cached) > 0


def test_host_tier_alone_serves_an_evicted_prefix(make_llm, model, reference):
    llm = make_llm(model, kv_offloading_size=0.01, **SMALL)
    run(llm, [prompt(0)])
    run(llm, [prompt(1)])  # (no flush: a block still queued for writing is served from the queue)
    tokens, cached = run(llm, [prompt(0)])
    counters, stats = tier_stats(llm)
    assert tokens == [reference[0]] and cached == [144] and stats["host"].hits == counters.blocks_loaded > 0


def test_an_aborted_request_waiting_for_its_load_leaves_nothing(make_llm, model, tmp_path):
    first = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    run(first, [prompt(0)])
    first.close()
    llm = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    engine = llm.engine
    engine.add_request(prompt(0), SamplingParams(temperature=0, max_tokens=4), request_id="r")
    assert engine.core.kv_tiers.loading and engine.core.kv_tiers.num_loading == 1  # held for its load
    engine.abort_request("r")
    while engine.core.has_unfinished_requests():
        engine.step()
    engine.core.check_integrity()
    assert engine.core.pool.num_cached_idle == 9  # (the loaded blocks stay, as cache)


def test_warm_prefixes_load_from_the_disk_tier(make_llm, model, reference, tmp_path):
    first = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    run(first, [prompt(0)])
    first.close()
    llm = make_llm(model, kv_disk_path=str(tmp_path), **SMALL)
    assert llm.engine.warm_prefixes([prompt(0)[:64]]) == 4  # pinned, loaded rather than prefilled
    assert tier_stats(llm)[0].blocks_loaded == 3 and llm.engine.core.num_prompt_tokens_total == 16
    tokens, cached = run(llm, [prompt(0)])
    assert tokens == [reference[0]] and cached == [144]
