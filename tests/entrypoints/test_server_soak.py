"""The hardening soak through one real server (`kiln serve` on loopback, with --api-key, --root-path,
runtime LoRA loading under a root, small send buffers, a short stall timeout), shared by every test
here; tools/soak_server.py holds the probes and runs the long soak (`--duration`):

- a smuggled request is never answered, and its connection closes;
- floods of large bodies (four copies at once of 240,000 tools, of 100,000 stop strings with
  n=32, of a 99,000-object body under the object cap; a 30 MB token-id prompt, a 30 MB chat) are
  400s, and /health and another stream keep moving. The bound here is 1 s, measured beside a
  quiet baseline: the strict 0.25 s of issue 39 is what `python tools/soak_server.py` prints
  (docs/serving.md has its figures), since a shared CI machine's scheduling alone can exceed it;
  before the JSON thread, four 99k-object bodies stalled both ~1.9 s (under load);
- the official openai client: concurrent streams (KILN_SERVER_SOAK_STREAMS, default 60), a third
  dropped half-way, give the idle server's greedy answers, and no KV block stays in use;
- a bounded soak (two rounds of every probe at once): 0 5xx, right answers, bad requests all
  4xx, every auth probe a 401 under and beside the root path, every LoRA path probe one and the
  same 400, a second address's small regex waits at most about one compile behind six
  forged-address slow schemas, unread streams pause and then deliver every token, 0 KV blocks in
  use after each round, RSS after the second round within 5% of the first's;
- slow readers: clients that stop reading and leave free their blocks within a second; those
  that stay are aborted after the stall timeout; RSS within 5% of before.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import openai
import pytest

from tools import soak_server
from tools.soak_server import gauges, rss_kb, unread_stream, wait_for

# The server's stream_stall_timeout_s: short, for the stalled readers' test, and several PAUSE_LOOK_S as
# the tool asks: the soak's unread streams are read ~2.5-3 s after their request, and a loaded CI
# machine left one unread past 6 s once and past 7.5 s once more (session 26's fresh-clone run, AMD Zen
# 4: cut off mid-event, as the stall cut-off closes a stream). One stalled round waits this long.
STALL_S = 5 * soak_server.PAUSE_LOOK_S


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    proc, url = soak_server.start(tiny_llama, work, stall_s=STALL_S)
    yield proc, url
    soak_server.stop_server(proc, work / "server.log")  # exit status 0, no traceback in the log


@pytest.mark.slow
def test_a_smuggled_request_is_never_answered(server):
    _, url = server
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
        s.settimeout(10)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked"
            b"\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 400 ") and out.count(b"\r\n\r\n") == 1, out


BIG_BODIES = {  # 30 MB each (issue 27): counted out before parsing / parsed on the JSON thread
    "30 MB token-id prompt": ("/v1/completions", b'{"model": "m", "prompt": [' + b"12," * 10_000_000 + b"12]}"),
    "30 MB chat": (
        "/v1/chat/completions",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 4800}] * 1250}).encode(),
    ),
}


@pytest.mark.slow
def test_floods_of_large_bodies_leave_health_and_streams_moving(server):
    _, url = server
    quiet_gap, quiet_health, _ = soak_server.flood_gaps(url, [], 0)
    print(f"\nquiet: another stream's longest gap {quiet_gap:.3f}s, slowest /health {quiet_health:.3f}s")
    worst = []
    # Four copies at once of the floods (the harder case), one of each 30 MB body.
    for name, body, copies in [(n, b, 4) for n, b in soak_server.FLOODS.items()] + [
        (n, b, 1) for n, b in BIG_BODIES.items()
    ]:
        gap, health, statuses = soak_server.flood_gaps(url, [body], copies)
        print(f"{name} x{copies}: another stream's longest gap {gap:.3f}s, slowest /health {health:.3f}s")
        assert statuses == [400] * copies, (name, statuses)
        worst.append((max(gap, health), name, gap, health))
    assert max(worst)[0] < 1.0, (max(worst), quiet_gap, quiet_health)


@pytest.mark.slow
def test_openai_client_streams_and_drops(server):
    _, url = server
    prompts = soak_server.PROMPTS
    streams = int(os.environ.get("KILN_SERVER_SOAK_STREAMS") or 60)  # (a third of them dropped)

    async def greedy(client: openai.AsyncOpenAI, i: int) -> tuple[int, str]:
        j = i % (2 * len(prompts))  # (one of the idle server's requests)
        stream = await client.completions.create(
            model="m",
            prompt=prompts[j % len(prompts)],
            max_tokens=4 + j,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return j, "".join([c.choices[0].text async for c in stream if c.choices])

    async def dropped(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        keep = 1 + i % 7
        async for _ in stream:
            keep -= 1
            if keep == 0:
                break
        await stream.close()

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=soak_server.KEY, http_client=http, max_retries=0)
            idle = dict([await greedy(client, i) for i in range(2 * len(prompts))])
            tasks = [greedy(client, i) if i % 3 else dropped(client, i) for i in range(streams)]
            results = await asyncio.gather(*tasks)
            return idle, [r for r in results if r is not None]

    idle, busy = asyncio.run(main())
    assert len(busy) == streams - len(range(0, streams, 3))
    assert all(text == idle[key] for key, text in busy), [(k, t, idle[k]) for k, t in busy if t != idle[k]][:3]
    soak_server.wait_idle(url, 30)


@pytest.mark.slow
def test_bounded_soak_of_every_probe(server):
    proc, url = server
    result = soak_server.soak(proc, url, duration=0.0, warm_rounds=1, streams=12, unread=(4, 2))
    print(f"\nsoak: {result.summary()}")
    assert result.rounds == 2 and result.requests > 100, result
    assert not result.failures(), result.failures()


@pytest.mark.slow
def test_slow_readers_free_their_blocks_and_stalled_ones_are_aborted(server):
    proc, url = server
    port = int(url.rsplit(":", 1)[1])
    streams = 12

    def stalled_round() -> float:
        """Clients that read nothing and stay: aborted after the stall timeout, blocks freed."""
        aborts = soak_server.aborted_requests(url)
        socks = [unread_stream(port, 1000, 1) for _ in range(streams)]
        wait_for(lambda: gauges(url)["kiln:num_requests_running"] > 0, 30)
        seconds = wait_for(
            lambda: not any(gauges(url).values()),
            STALL_S + 40,  # (once the send buffers are full)
            show=lambda: f"{gauges(url)}, {soak_server.aborted_requests(url) - aborts} aborted",
        )
        assert soak_server.aborted_requests(url) - aborts == streams  # (too little read to finish)
        for s in socks:
            s.close()
        return seconds

    # (memory is at its plateau: the soak before this took it there with streams that paused)
    rss_before = rss_kb(proc.pid)
    # Clients that read nothing, then leave: their blocks are free within a second.
    socks = [unread_stream(port, 1000, 1) for _ in range(streams)]
    wait_for(lambda: gauges(url)["kiln:num_requests_running"] == streams, 30)
    time.sleep(1.0)
    assert gauges(url)["kiln:num_kv_blocks_in_use"] > 0
    for s in socks:
        s.close()
    freed = wait_for(lambda: gauges(url)["kiln:num_kv_blocks_in_use"] == 0, 10, 0.02)
    aborted = stalled_round()
    time.sleep(0.5)
    rss_after = rss_kb(proc.pid)
    print(
        f"\nslow readers: {streams} streams; blocks free {freed:.2f}s after the clients left; stalled streams "
        f"aborted within {aborted:.1f}s (stall timeout {STALL_S:g}s); server RSS {rss_before / 1024:.0f} MB -> "
        f"{rss_after / 1024:.0f} MB"
    )
    assert freed < 1.0, freed
    assert rss_after <= rss_before * 1.05, (rss_before, rss_after)
