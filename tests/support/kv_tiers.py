"""Helpers of the KV tiers' engine tests: a pool two long prompts evict each other from, prompts,
greedy runs, the tiers' counters, and a real redis-server on a free port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager

from engine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
BS = 16
SMALL = dict(max_model_len=160, num_gpu_blocks=16, max_num_seqs=4)  # 15 blocks: two long prompts evict each other


def prompt(seed: int, n: int = 150) -> list[int]:
    return [(seed * 131 + i * 7) % 480 + 10 for i in range(n)]


def run(llm, prompts, params=GREEDY, **kw):
    """Greedy token ids and cached prompt tokens of each prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def tier_stats(llm):
    tiers = llm.engine.core.kv_tiers
    return tiers.counters, {t.name: t.stats for t in tiers.store.tiers}


@contextmanager
def redis_server(workdir, fail, skip):
    """A redis-server on a free port (no persistence); yields its URL. Missing: `fail` under CI
    (make test installs it), else `skip`."""
    exe = shutil.which("redis-server")
    if exe is None:
        why = "redis-server is not installed (apt-get install redis-server; make test does it as root)"
        (fail if os.environ.get("CI") else skip)(why)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from engine.core.kv.tiers.resp import RespClient, RespError

    url = f"redis://127.0.0.1:{port}/0"
    client = RespClient(url, timeout=1.0)
    try:
        for _ in range(200):
            try:
                client.command("PING")
                break
            except RespError:
                time.sleep(0.05)
        else:
            fail("redis-server did not start")
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
