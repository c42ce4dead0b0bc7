"""The served OpenAI API under load and when clients go away: a client disconnecting mid-stream or
during a non-streaming request frees its blocks, 200 concurrent streams all complete, and the
Prometheus exposition. (The shared server: conftest.py.)
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.support.server import API_KEY, AUTH, MODEL, metrics, wait_clean


# ------------------------------------------------------------------ load, disconnects, metrics
def test_client_disconnect_mid_stream_frees_blocks(url):
    before = metrics(url)
    body = {"prompt": "The quick brown fox", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as resp:
            lines = resp.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                if got == 3:
                    break
            during = metrics(url)
            assert during["kiln:num_kv_blocks_in_use"] >= 2 and during["kiln:num_requests_running"] == 1
        # leaving the block closes the connection mid-stream
    after = wait_clean(url, timeout=10)
    assert (
        after["kiln:request_success_total{finished_reason=abort}"]
        == before["kiln:request_success_total{finished_reason=abort}"] + 1
    )
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] < 1000


def test_client_gone_during_non_streaming_request_aborts_it(url):
    before = metrics(url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 1000 tokens are done
        httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(0.1, connect=10, write=10),
        )
    after = wait_clean(url, timeout=10)
    assert (
        after["kiln:request_success_total{finished_reason=abort}"]
        == before["kiln:request_success_total{finished_reason=abort}"] + 1
    )
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] < 1000


def test_200_concurrent_streams_all_complete(url):
    before = metrics(url)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request number {i}:",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run_all())
    assert len(results) == 200 and all(n == 8 for _, n in results)
    after = wait_clean(url)
    assert (
        after["kiln:request_success_total{finished_reason=length}"]
        - before["kiln:request_success_total{finished_reason=length}"]
        == 200
    )
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] == 1600
    assert after["kiln:time_to_first_token_seconds_count"] - before["kiln:time_to_first_token_seconds_count"] == 200
    assert after["kiln:e2e_request_latency_seconds_count"] - before["kiln:e2e_request_latency_seconds_count"] == 200
    assert after["kiln:inter_token_latency_seconds_count"] > before["kiln:inter_token_latency_seconds_count"]
    assert after["kiln:prompt_tokens_total"] > before["kiln:prompt_tokens_total"]


def test_metrics_exposition(url):
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
        "cpu_cache_usage_perc",
        "kv_cache_fragmentation_ratio",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "num_kv_blocks_in_use",
        "swap_out_bytes_total",
        "swap_in_bytes_total",
        "num_pinned_prefix_blocks",
        "weight_copy_bytes",
    ):
        assert f"kiln:{name}{{" in text, name
    assert f'model_name="{MODEL}"' in text
    m = metrics(url)
    assert m["kiln:prefix_cache_queries_total"] >= m["kiln:prefix_cache_hits_total"] >= 0
    assert m["kiln:num_kv_blocks_total"] == 1024
