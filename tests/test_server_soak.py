"""Soak through the real server (`python -m engine.entrypoints.cli serve`, loopback) with the official openai
client: many concurrent streams, some dropped by their client half-way, while other clients send
pathological schemas, oversized bodies and invalid ones. Then: no 5xx, no KV block in use, the
greedy outputs of the well-formed requests equal an idle server's, and the server's RSS is
within 5% of what it was before.

KILN_SERVER_SOAK_STREAMS (read from the environment) sets the number of streams
(default 200).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import launch_server, stop_server

PROMPTS = ["The cat", "Once upon a time", "def main():", "1, 2, 3,", "Hello there", "In the beginning",
           "Paris is", "import numpy"]


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:num_kv_blocks_in_use")}


async def _greedy(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
    j = i % (2 * len(PROMPTS))  # one of the idle server's requests
    prompt = PROMPTS[j % len(PROMPTS)]
    max_tokens = 4 + (j * 7) % 17
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
    return f"{prompt}|{max_tokens}", text


async def _dropped(client: openai.AsyncOpenAI, rng: random.Random) -> None:
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": rng.choice(PROMPTS)}], max_tokens=200, stream=True,
        extra_body={"ignore_eos": True})
    keep = rng.randint(1, 10)
    async for _ in stream:
        keep -= 1
        if keep == 0:
            break
    await stream.close()


async def _abuse(http: httpx.AsyncClient, k: int) -> list[int]:
    """Statuses of bad requests: each must be a 4xx."""
    schema = {"type": "object", "properties": {f"k{k}_{i}": {"type": "string"} for i in range(3000)}}
    bodies = [
        ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "guided_json": schema, "user": f"evil{k}"})),
        ("/v1/completions", '{"model": "m", "prompt": "' + "a" * (2 << 20) + '"}'),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        ("/v1/completions", '{"model": "m", "prompt": "hi", "max_tokens": ,}'),
        ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "temperature": -1})),
        ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "max_tokens": 10 ** 6})),
        ("/v1/embeddings", json.dumps({"model": "nope", "input": "hi"})),
    ]
    out = []
    for path, body in bodies:
        resp = await http.post(path, content=body.encode("utf-8", "surrogatepass"),
                               headers={"content-type": "application/json"})
        out.append(resp.status_code)
    return out


@pytest.mark.slow
def test_server_soak_with_openai_client(tiny_llama, tmp_path):
    num_streams = int(os.environ.get("KILN_SERVER_SOAK_STREAMS") or 200)
    proc, url = launch_server(tiny_llama, tmp_path / "server.log", "--max-model-len", "256", "--max-num-seqs", "64",
                              "--served-model-name", "m", "--max-request-body-mb", "1",
                              "--grammar-compile-timeout-s", "3", "--log-level", "warning")
    try:
        async def main():
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", http_client=http, max_retries=0)
                # The idle server's answers, one at a time; this also warms everything up.
                idle = dict([await _greedy(client, i) for i in range(len(PROMPTS) * 2)])
                await _abuse(http, -1)  # the compile workers start with the first constrained request
                await asyncio.sleep(1.0)
                rss_before = _rss_kb(proc.pid)

                rng = random.Random(7)
                t0 = time.monotonic()
                tasks = []
                for i in range(num_streams):
                    if i % 3 == 2:
                        tasks.append(_dropped(client, rng))
                    else:
                        tasks.append(_greedy(client, i))
                abuse = [_abuse(http, k) for k in range(4)]
                results = await asyncio.gather(*tasks, *abuse, return_exceptions=True)
                elapsed = time.monotonic() - t0
                errors = [r for r in results if isinstance(r, BaseException)]
                assert not errors, errors[:3]
                busy = [r for r in results[:num_streams] if r is not None]
                for key, text in busy:
                    assert text == idle[key], (key, text, idle[key])
                statuses = [s for r in results[num_streams:] for s in r]
                assert all(400 <= s < 500 for s in statuses), statuses
                assert 413 in statuses
                deadline = time.monotonic() + 30
                while any(_gauges(url).values()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert not any(_gauges(url).values()), _gauges(url)
                # Same work again at idle: memory reached its plateau during the soak, it must not keep growing.
                await asyncio.sleep(1.0)
                return rss_before, _rss_kb(proc.pid), elapsed, len(busy)

        rss_before, rss_after, elapsed, checked = asyncio.run(main())
        print(f"soak: {num_streams} streams ({checked} compared with the idle server) + 28 bad requests in "
              f"{elapsed:.1f}s; server RSS {rss_before / 1024:.0f} MB -> {rss_after / 1024:.0f} MB")
        assert rss_after <= rss_before * 1.05, (rss_before, rss_after)
    finally:
        stop_server(proc, tmp_path / "server.log")  # exit status 0, no traceback in the log
