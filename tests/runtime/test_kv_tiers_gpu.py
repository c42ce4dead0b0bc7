"""The KV tiers on a GPU (tools/gpu_check.sh's swap group): the host tier keeps its records in
pinned memory, the block copies stage through pinned memory without a blocking upload, and a
prefix evicted from the device's pool comes back from the host tier with the tokens of its first,
computed visit."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.pinned_host_tier import PinnedHostTier
from engine.worker.host_upload import BlockingUploads
from engine.worker.kv_block_io import KVBlockIO
from tests.support.kv_tiers import SMALL, prompt, run, tier_stats

pytestmark = pytest.mark.gpu


def test_block_io_on_the_gpu_stages_through_pinned_memory():
    torch.manual_seed(0)
    cache = torch.randn(4, 2, 64, 16, 8, 128, device="cuda").to(torch.bfloat16)
    io = KVBlockIO(cache)
    assert io.pinned
    src, dst = [3, 17, 40], [5, 6, 63]
    with BlockingUploads() as calls:
        payloads = io.read(src)
        io.write(dst, payloads)
    torch.cuda.synchronize()
    assert not calls.where, calls.where
    assert torch.equal(cache[:, :, dst], cache[:, :, src])


def test_pinned_host_tier_serves_an_evicted_prefix_equal(make_llm, tiny_llama):
    llm = make_llm(tiny_llama, device="cuda", kv_offloading_size=0.01, **SMALL)
    tiers = llm.engine.core.kv_tiers
    (host,) = tiers.store.tiers
    assert isinstance(host, PinnedHostTier)
    first, _ = run(llm, [prompt(0)])  # computed
    run(llm, [prompt(1)])  # evicts prompt 0's blocks from the pool
    tiers.flush()
    keys = list(host._records)
    assert keys and all(host.is_pinned(k) for k in keys)
    tokens, cached = run(llm, [prompt(0)])
    counters, stats = tier_stats(llm)
    assert tokens == first and cached == [144]
    assert stats["host"].hits == counters.blocks_loaded > 0
