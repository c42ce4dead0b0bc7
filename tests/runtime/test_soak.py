"""Soak: thousands of requests through a KV cache far too small for them, on the CPU.

Random prompt and output lengths (prompts share a few prefixes, so prefix-cache blocks are
shared between requests), random priorities, random `n`, random aborts; a pool small enough
that preemption by swap and by recompute both happen many times (preemption_mode=auto with
a small swap space), and a reserve for urgent requests. Every request that was not aborted
must end with exactly the greedy tokens of an unconstrained run; the block-pool integrity
check must hold after every step; both pools must end fully free.

KILN_SOAK_REQUESTS (read from the environment) sets the number of requests
(default 2000, about a minute on two CPU cores).
"""

from __future__ import annotations

import os
import random
import time

from engine.core.params import SamplingParams
from engine.layers.kv_cache import KVCache

BLOCK = 8


def _workload(num_requests: int, seed: int):
    rng = random.Random(seed)
    system = [[rng.randrange(5, 500) for _ in range(rng.choice([8, 16, 20]))] for _ in range(4)]
    reqs = []
    for i in range(num_requests):
        prompt = list(rng.choice(system)) if rng.random() < 0.6 else []
        prompt += [rng.randrange(5, 500) for _ in range(rng.randint(1, 14))]
        reqs.append(
            dict(
                rid=f"soak-{i}",
                prompt=prompt,
                max_tokens=rng.randint(1, 14),
                n=rng.choice([1, 1, 1, 1, 2, 3]),
                priority=rng.choice([0, 1, 1, 2, 2, 3]),
                detokenize=rng.random() < 0.1,
            )
        )
    return reqs


def _params(r, n=None):
    return SamplingParams(
        n=r["n"] if n is None else n, temperature=0.0, max_tokens=r["max_tokens"], detokenize=r["detokenize"]
    )


def test_soak_swap_recompute_priorities_aborts(make_llm):
    num_requests = int(os.environ.get("KILN_SOAK_REQUESTS") or 2000)
    reqs = _workload(num_requests, seed=1234)
    t0 = time.perf_counter()

    # The unconstrained run: room for everything, no preemption; one sample per distinct request.
    ref = make_llm(max_num_seqs=128, max_model_len=64, block_size=BLOCK, max_num_batched_tokens=2048)
    ref_outs = ref.generate([r["prompt"] for r in reqs], [_params(r, n=1) for r in reqs], use_tqdm=False)
    expected = {r["rid"]: o.outputs[0].token_ids for r, o in zip(reqs, ref_outs)}
    assert ref.engine.core.scheduler.num_preemptions == 0
    t_ref = time.perf_counter() - t0

    cfg = ref.engine.model_config
    per_block = KVCache.bytes_per_block(
        cfg.num_layers, BLOCK, cfg.num_kv_heads, cfg.head_dim, ref.engine.core.kv_cache.tensor.dtype
    )
    llm = make_llm(
        max_num_seqs=12,
        max_model_len=64,
        block_size=BLOCK,
        num_gpu_blocks=24,
        max_num_batched_tokens=48,
        preemption_mode="auto",
        swap_space_gb=16 * per_block / (1 << 30),
        reserved_blocks_fraction=0.1,
        reserved_priority=0,
    )
    eng = llm.engine
    assert eng.core.swap_space is not None and eng.core.swap_space.num_blocks == 16

    rng = random.Random(99)
    pending = list(reqs)
    live: list[str] = []
    done: dict[str, list[list[int]]] = {}
    aborted: set[str] = set()
    steps = 0
    max_swapped = 0
    while pending or eng.core.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if pending:
                r = pending.pop(0)
                eng.add_request(r["prompt"], _params(r), r["rid"], priority=r["priority"])
                live.append(r["rid"])
        if live and rng.random() < 0.04:
            rid = live.pop(rng.randrange(len(live)))
            if eng.abort_request(rid) is not None:
                aborted.add(rid)
        outputs = eng.step()
        steps += 1
        eng.core.check_integrity()
        max_swapped = max(max_swapped, eng.core.scheduler.num_requests_swapped)
        for out in outputs:
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = [c.token_ids for c in out.outputs]
                live.remove(out.request_id)
        assert steps < 200 * num_requests, "the engine stopped making progress"

    assert eng.core.is_idle_and_free() and eng.core.pool.is_fully_free() and eng.core.swap_space.is_fully_free()
    assert set(done) | aborted == {r["rid"] for r in reqs} and not set(done) & aborted
    wrong = [rid for rid, outs in done.items() if any(o != expected[rid] for o in outs)]
    assert not wrong, f"{len(wrong)} requests differ from the unconstrained run, e.g. {wrong[:5]}"

    sched = eng.core.scheduler
    by_mode = sched.preemptions_by_mode
    summary = (
        f"{num_requests} requests ({len(aborted)} aborted), {steps} steps, preemptions {by_mode}, "
        f"swap fallbacks {sched.num_swap_fallbacks}, swapped out {eng.core.swap_space.bytes_out} B, "
        f"blocks reused at swap-in {eng.core.swap_space.blocks_reused}, "
        f"discarded {eng.core.swap_space.blocks_discarded}, "
        f"max requests swapped {max_swapped}, ref {t_ref:.1f}s, total {time.perf_counter() - t0:.1f}s"
    )
    print(summary)
    assert by_mode["swap"] >= num_requests // 50 and by_mode["recompute"] >= num_requests // 50, summary
    space = eng.core.swap_space
    # Every block swapped out came back (copied or found still cached), or was dropped with its
    # request (aborted while swapped out, or demoted to recompute).
    assert (
        space.bytes_out == space.bytes_in + (space.blocks_reused + space.blocks_discarded) * space.bytes_per_block > 0
    )
    assert len(aborted) >= num_requests // 100
