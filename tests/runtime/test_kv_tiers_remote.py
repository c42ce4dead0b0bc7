"""The remote KV tier against a real Redis server (Debian's redis-server, started here on a free
port; `make test` installs the package): two engines that share no disk serve each other's
prefixes through it, equal to a recompute; a damaged value is recomputed; and the RESP client
speaks to the server as redis-cli would."""

from __future__ import annotations

import pytest

from tests.support.kv_tiers import SMALL, prompt, redis_server, run, tier_stats


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis"), pytest.fail, pytest.skip) as url:
        yield url


def test_resp_client_round_trips(redis_url):
    from engine.core.kv.tiers.resp import RespClient, RespError

    c = RespClient(redis_url)
    blob = bytes(range(256)) * 1000 + b"\r\n$-1\r\n"  # (binary-safe)
    assert c.command("SET", "kiln:test", blob) == b"OK"
    assert c.command("GET", "kiln:test") == blob
    assert c.command("EXISTS", "kiln:test") == 1 and c.command("GET", "kiln:none") is None
    with pytest.raises(RespError, match="unknown command"):
        c.command("NOPE")
    c.close()
    assert c.command("DEL", "kiln:test") == 1  # (reconnects)


def test_two_engines_share_prefixes_through_redis(make_llm, tiny_llama, redis_url, tmp_path):
    plain = make_llm(tiny_llama, **SMALL)
    want, _ = run(plain, [prompt(5)])
    first = make_llm(tiny_llama, kv_remote_url=redis_url, **SMALL)
    assert run(first, [prompt(5)])[0] == want
    first.engine.core.kv_tiers.flush()
    second = make_llm(tiny_llama, kv_remote_url=redis_url, **SMALL)  # no disk, nothing shared but the server
    tokens, cached = run(second, [prompt(5)])
    assert tokens == want and cached == [144]
    assert tier_stats(second)[1]["remote"].hits == 9
    # A damaged value is recomputed, not served.
    from engine.core.kv.tiers.resp import RespClient

    run(first, [prompt(6)])
    first.engine.core.kv_tiers.flush()
    client = RespClient(redis_url)
    keys = client.command("KEYS", "kiln:kv:*")
    assert len(keys) == 18
    for key in keys:
        value = client.command("GET", key)
        client.command("SET", key, value[:-1] + bytes([value[-1] ^ 1]))  # a flipped checksum bit
    third = make_llm(tiny_llama, kv_remote_url=redis_url, **SMALL)
    tokens, cached = run(third, [prompt(6)])
    assert tokens == run(plain, [prompt(6)])[0] and cached == [0]
    assert tier_stats(third)[1]["remote"].errors == 1  # (the run stops at the first bad block)
    client.close()
