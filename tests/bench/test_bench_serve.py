"""`kiln bench serve`: metric definitions, arrivals, and a real run against the app under uvicorn."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from engine.bench.serve import base_url, main
from engine.bench.serve_data import arrival_gaps, read_sharegpt
from engine.bench.serve_metrics import RequestResult, meets_slos, parse_goodput, percentile, summarize
from engine.config.server_settings import ServerSettings
from engine.config.settings import EngineSettings
from engine.entrypoints.openai.app import build_app, create_state
from tests.support.engine import assert_engine_clean


def test_metric_definitions_match_vllm():
    a = RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1])
    b = RequestResult(ok=True, prompt_len=10, output_tokens=1, ttft=0.2, latency=0.2, itl=[])
    c = RequestResult(ok=False, error="HTTP 503")
    s = summarize([a, b, c], duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"HTTP 503": 1}
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / (5 - 1); b has one token: no TPOT
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["output_throughput"] == pytest.approx(3.0) and s["request_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    gaps = arrival_gaps(4000, rate=10.0, seed=3)
    assert gaps == arrival_gaps(4000, rate=10.0, seed=3) != arrival_gaps(4000, rate=10.0, seed=4)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert arrival_gaps(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


@pytest.fixture
def live_server(tiny_llama):
    import uvicorn

    state = create_state(
        EngineSettings(
            model=str(tiny_llama),
            device="cpu",
            enforce_eager=True,
            max_model_len=128,
            num_gpu_blocks=128,
            max_num_seqs=16,
            log_stats_interval=0,
        ),
        ServerSettings(served_model_name="bench", api_key="k"),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(15)
    sock.close()
    assert_engine_clean(state.engine.engine)


def test_base_url_with_or_without_v1():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert base_url(url) == "http://h:8000"


def test_goodput_counts_requests_meeting_every_slo():
    fast = RequestResult(ok=True, prompt_len=4, output_tokens=3, ttft=0.1, latency=0.3, itl=[0.1, 0.1])
    slow = RequestResult(ok=True, prompt_len=4, output_tokens=3, ttft=0.9, latency=1.1, itl=[0.1, 0.1])
    slos = parse_goodput(["ttft:500", "tpot:150"])
    assert slos == {"ttft": 500.0, "tpot": 150.0}
    assert meets_slos(fast, slos) and not meets_slos(slow, slos)
    s = summarize([fast, slow], duration=2.0, percentiles=(50, 90), goodput=slos)
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.5)
    assert set(s["ttft_ms"]) >= {"mean", "median", "p50", "p90"}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])


def _sharegpt_file(path):
    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"question number {i} about kiln and clay ovens please"},
                {"from": "gpt", "value": "an answer with a few words in it " * (1 + i % 3)},
            ],
        }
        for i in range(20)
    ]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_reader(tmp_path):
    pairs = read_sharegpt(_sharegpt_file(tmp_path / "sg.json"))
    assert len(pairs) == 20 and pairs[0][0].startswith("question number 0")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="ShareGPT"):
        read_sharegpt(tmp_path / "bad.json")


def test_bench_against_live_server(live_server, tmp_path, capsys):
    url, state = live_server
    out = tmp_path / "bench.json"
    rc = main(
        [
            "--base-url",
            url + "/v1",
            "--api-key",
            "k",
            "--num-prompts",
            "12",
            "--request-rate",
            "50",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--max-concurrency",
            "8",
            "--ignore-eos",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            out.name,
            "--metric-percentiles",
            "50,90,99",
            "--goodput",
            "e2el:60000",
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert len(result["ttfts"]) == 12 and result["e2el_ms"]["p90"] > 0
    assert result["completed"] == 12 and result["failed"] == 0 and result["model"] == "bench"
    assert result["total_output_tokens"] == 72 and result["total_input_tokens"] == 96
    assert 0 < result["ttft_ms"]["median"] <= result["e2el_ms"]["median"]
    assert result["tpot_ms"]["mean"] > 0 and result["itl_ms"]["mean"] > 0
    printed = capsys.readouterr()
    for line in (
        "Mean TTFT (ms):",
        "P99 ITL (ms):",
        "P90 E2EL (ms):",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
    ):
        assert line in printed.out
    assert "HTTP Request" not in printed.err  # no log line per request
    # failures are counted, not hidden: a wrong key makes every request fail
    rc = main(["--url", url, "--model", "bench", "--api-key", "wrong", "--num-prompts", "2", "--output-len", "2"])
    assert rc == 1 and "HTTP 401" in capsys.readouterr().out


def test_bench_chat_endpoint_with_sharegpt(live_server, tmp_path, capsys):
    url, state = live_server
    data = _sharegpt_file(tmp_path / "sg.json")
    out = tmp_path / "chat.json"
    rc = main(
        [
            "--url",
            url,
            "--api-key",
            "k",
            "--backend",
            "openai-chat",
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(data),
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--request-rate",
            "40",
            "--sharegpt-output-len",
            "5",
            "--ignore-eos",
            "--json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 30
    assert result["config"]["endpoint"] == "/v1/chat/completions"
    assert 0 < result["ttft_ms"]["median"] <= result["e2el_ms"]["p99"] and result["itl_ms"]["mean"] > 0
    text = capsys.readouterr().out
    assert "Mean TTFT (ms):" in text and "P99 E2EL (ms):" in text


def test_bench_random_chat_prompts(live_server, tmp_path):
    url, state = live_server
    out = tmp_path / "rc.json"
    rc = main(
        [
            "--url",
            url,
            "--api-key",
            "k",
            "--backend",
            "openai-chat",
            "--num-prompts",
            "4",
            "--input-len",
            "6",
            "--output-len",
            "3",
            "--ignore-eos",
            "--json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0 and json.loads(out.read_text())["total_output_tokens"] == 12


def test_random_prompts_are_the_same_token_ids_for_a_llama_cpp_server():
    """llama-server's /tokenize and /detokenize take {"content": ...}: the client finds them and
    draws the same token-id prompts as from a server with vLLM's bodies (same vocabulary)."""
    import asyncio
    import json as _json

    import httpx

    from engine.bench.serve_data import BenchConfig, ServerTokenizer, random_requests

    def vocab(text: str) -> list[int]:
        return [sum(map(ord, w)) % 500 for w in text.split()]

    def llama_cpp(request: httpx.Request) -> httpx.Response:
        body = _json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": vocab(body.get("content", ""))})
        return httpx.Response(200, json={"content": " ".join(map(str, body["tokens"]))})

    def vllm(request: httpx.Request) -> httpx.Response:
        body = _json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": vocab(body["prompt"])})
        return httpx.Response(200, json={"prompt": " ".join(map(str, body["tokens"]))})

    async def draw(handler, backend="openai"):
        cfg = BenchConfig(
            url="http://t",
            model="m",
            num_prompts=5,
            request_rate=float("inf"),
            max_concurrency=None,
            input_len=12,
            output_len=4,
            seed=3,
            backend=backend,
        )
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t") as http:
            return [r.prompt for r in await random_requests(ServerTokenizer(http, cfg, {}), cfg)]

    ours, theirs = asyncio.run(draw(vllm)), asyncio.run(draw(llama_cpp))
    assert ours == theirs and all(isinstance(p, list) and len(p) == 12 for p in ours)
    assert asyncio.run(draw(llama_cpp, "openai-chat")) == asyncio.run(draw(vllm, "openai-chat"))
