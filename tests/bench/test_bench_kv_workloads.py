"""tools/bench_kv_workloads.py against a real kiln server: the prompt tokens and cached tokens it
reports are the server's own counts (so a tokenizer mismatch between peers shows in its table),
returning documents are counted apart from first visits, and the peers' command lines hold what
makes their figures comparable."""

from __future__ import annotations

import argparse

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.server import app_states, serving
from tools import bench_kv_workloads as bench


@pytest.fixture
def make_app(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=512, num_gpu_blocks=256, max_num_seqs=2, enable_prefix_caching=True)


def _args(**kw) -> argparse.Namespace:
    base = dict(seed=0, docs=2, doc_tokens=40, rounds=2, max_tokens=3, cores="0-1", max_model_len=8192)
    base |= dict(model="m.gguf", tokenizer_dir="/hf", pool_tokens=8192, port=8391, kiln_python="python")
    base |= dict(host_gb=2.0, disk_gb=8.0, llama_cpp_dir="/ll", vllm_venv="/v", vllm_model="/hf")
    base |= dict(kv_bytes_per_token=23040)
    return argparse.Namespace(**(base | kw))


def test_documents_count_the_servers_tokens(make_app, tiny_llama, monkeypatch):
    monkeypatch.setattr(bench, "SERVED_NAME", "m")
    state, app = make_app()
    a = _args()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    expected = sum(len(tok(prompt).input_ids) for _, prompt in bench.documents(a))
    with serving(app, state.settings) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            r = bench.run_documents(http, a)
    assert r["prompt_tokens"] == expected
    # each document's second round finds its first round's full blocks in the pool
    assert r["return_cached_tokens_median"] is not None and r["return_cached_tokens_median"] >= 16
    assert r["output_tok_s"] > 0 and r["first_ttft_median_s"] > 0 and r["return_ttft_p99_s"] > 0


def test_peer_command_lines():
    names = {name: cmd for name, cmd, _ in bench.servers(_args(), bench.Path("/tmp/w"))}
    assert list(names) == [
        "kiln",
        "kiln+host",
        "kiln+disk",
        "kiln+disk/restart",
        "llama-server",
        "llama-server/no-ram",
        "vLLM",
    ]
    assert names["kiln"][names["kiln"].index("--tokenizer") + 1] == "/hf"
    assert "--enable-prompt-tokens-details" in names["vLLM"] and "/hf" in names["vLLM"]
    # the same usable pool of 8,192 tokens: kiln's 512 blocks of 16, vLLM's 256 of 32 and its null block
    assert names["kiln"][names["kiln"].index("--num-gpu-blocks-override") + 1] == "512"
    assert names["vLLM"][names["vLLM"].index("--num-gpu-blocks-override") + 1] == "257"
    assert names["vLLM"][names["vLLM"].index("--block-size") + 1] == "32"
    assert names["llama-server/no-ram"][-2:] == ["--cache-ram", "0"]
