"""Issue 39's probes through one real server (`kiln serve` with --api-key, --root-path, runtime
LoRA loading under a root, small send buffers; tools/soak_server.py holds the probes and runs the
long soak with --duration):

- floods of large bodies (240,000 tools, 100,000 stop strings with n=32, a 99,000-object body
  under the object cap; one and four copies at once) are 400s, and /health and another stream
  keep moving. The bound here is 1 s, measured beside a quiet baseline: the strict 0.25 s of the
  issue is what `python tools/soak_server.py` prints (docs/serving.md has its figures), since a
  shared CI machine's scheduling alone can exceed it. Before the JSON thread, four 99k-object
  bodies stalled both ~1.9 s (under load), so the looser bound still fails the old parser.
- a bounded soak (two rounds of every probe at once): 0 5xx, right answers, every auth probe a
  401 under and beside the root path, every LoRA path probe one and the same 400, a second
  address's small regex waits at most about one compile behind six forged-address slow schemas,
  unread streams pause and then deliver every token, 0 KV blocks in use after each round, RSS
  after the second round within 5% of the first's.
"""

from __future__ import annotations

import pytest

from tools import soak_server


@pytest.fixture(scope="module")
def soak_server_url(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    proc, url = soak_server.start(tiny_llama, work)
    yield proc, url
    soak_server.stop_server(proc, work / "server.log")  # exit status 0, no traceback in the log


@pytest.mark.slow
def test_floods_of_large_bodies_leave_health_and_streams_moving(soak_server_url):
    _, url = soak_server_url
    quiet_gap, quiet_health, _ = soak_server.flood_gaps(url, [], 0)
    print(f"\nquiet: another stream's longest gap {quiet_gap:.3f}s, slowest /health {quiet_health:.3f}s")
    worst = []
    for name, body in soak_server.FLOODS.items():
        for copies in (1, 4):
            if copies == 1 and name.startswith("99k"):
                continue  # (four copies are the harder case; time kept for them)
            gap, health, statuses = soak_server.flood_gaps(url, [body], copies)
            print(f"{name} x{copies}: another stream's longest gap {gap:.3f}s, slowest /health {health:.3f}s")
            assert statuses == [400] * copies, (name, statuses)
            worst.append((gap, health, name, copies))
    gap, health, name, copies = max(worst)
    assert gap < 1.0, (name, copies, gap, quiet_gap)
    assert max(h for _, h, _, _ in worst) < 1.0, worst


@pytest.mark.slow
def test_bounded_soak_of_every_probe(soak_server_url):
    proc, url = soak_server_url
    result = soak_server.soak(proc, url, duration=0.0, warm_rounds=1, streams=12, unread=(4, 2))
    print(f"\nsoak: {result.summary()}")
    assert result.rounds == 2 and result.requests > 100, result
    assert not result.failures(), result.failures()
