"""tools/bench_vs_llamacpp_serve.py, the served peer comparison: which clients load each server
(vLLM's own `vllm bench serve` with the issue's flags, beside kiln's), the same mixed texts for
both clients, and the medians table with kiln's ratios for the servers' ready time and memory."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.bench.serve import request_body
from engine.bench.serve_data import BenchConfig, SampleRequest
from tools.bench_vs_llamacpp_serve import SERVER_METRICS, add_serve_args, clients, kiln_client, table, vllm_client


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    p.add_argument("--kiln-python", default="python")
    return p.parse_args(list(argv))


def test_clients_default_to_both_with_a_vllm_venv():
    assert clients(_args()) == ["kiln"]
    assert clients(_args("--vllm-venv", "/v", "--vllm-model", "/m")) == ["vllm", "kiln"]
    assert clients(_args("--vllm-venv", "/v", "--vllm-model", "/m", "--serve-client", "kiln")) == ["kiln"]
    with pytest.raises(SystemExit, match="needs --vllm-venv"):
        clients(_args("--serve-client", "vllm"))
    with pytest.raises(SystemExit, match="needs --vllm-venv"):
        clients(_args("--vllm-venv", "/v", "--serve-client", "both"))


def test_vllm_client_runs_the_issues_load(tmp_path):
    a = _args("--vllm-venv", "/v", "--vllm-model", "/m", "--serve-prompts", "100", "--serve-concurrency", "16")
    argv = vllm_client(a, tmp_path, tmp_path / "r.json", 2)
    assert argv[:3] == ["/v/bin/vllm", "bench", "serve"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--dataset-name") == "random" and flag("--random-input-len") == "64"
    assert flag("--random-output-len") == "64" and flag("--num-prompts") == "100"
    assert flag("--max-concurrency") == "16" and flag("--tokenizer") == "/m" and flag("--seed") == "2"
    assert "--ignore-eos" in argv and flag("--result-filename") == "r.json" and flag("--result-dir") == str(tmp_path)


def test_sampling_parameters_reach_both_clients_and_the_request(tmp_path):
    sampling = ("temperature=0.8", "top_p=0.95", "top_k=40")
    a = _args("--vllm-venv", "/v", "--vllm-model", "/m", "--serve-sampling", *sampling)
    for argv in (vllm_client(a, tmp_path, tmp_path / "r.json", 0), kiln_client(a, tmp_path, tmp_path / "r.json", 0)):
        assert [argv[argv.index(f) + 1] for f in ("--temperature", "--top-p", "--top-k")] == ["0.8", "0.95", "40"]
        assert "--min-p" not in argv
    assert "--top-p" not in vllm_client(_args("--vllm-venv", "/v", "--vllm-model", "/m"), tmp_path, tmp_path / "r", 0)
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        kiln_client(_args("--serve-sampling", "top_q=1"), tmp_path, tmp_path / "r.json", 0)
    cfg = BenchConfig("http://x", None, 1, 1.0, None, 4, 4, 0, temperature=0.8, top_p=0.95, top_k=40)
    body = request_body(cfg, "m", SampleRequest("hi", 1, 4))
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.8, 0.95, 40) and "min_p" not in body


def test_mixed_texts_are_the_same_for_both_clients(tmp_path):
    a = _args("--vllm-venv", "/v", "--vllm-model", "/m", "--serve-dataset", "mixed", "--serve-output-len", "32")
    convs = [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok"}]} for t in ("a b", "c")]
    (tmp_path / "mixed_prompts.json").write_text(json.dumps(convs))  # (as the first server's /tokenize sized it)
    argv = vllm_client(a, tmp_path, tmp_path / "r.json", 0)
    assert argv[argv.index("--dataset-name") + 1] == "custom" and argv[argv.index("--custom-output-len") + 1] == "32"
    lines = (tmp_path / "mixed_prompts.jsonl").read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == ["a b", "c"]


def test_server_table_gives_kilns_ratios():
    runs = {
        "llama.cpp": [{"ready_s": 2.0, "peak_rss_GB": 0.5}] * 3,
        "kiln": [{"ready_s": 4.0, "peak_rss_GB": 1.0}, {"ready_s": 9.0, "peak_rss_GB": 1.0}, {"ready_s": 3.0}],
    }
    # a run without a figure leaves that row out rather than a median of fewer runs
    rows = {line.split("|")[1].strip(): line for line in table(runs, SERVER_METRICS).splitlines()[2:]}
    assert list(rows) == ["ready s (lower is better)"]
    assert rows["ready s (lower is better)"].replace(" ", "").endswith("|2.0|4.0|2.00x|")


def test_served_table_sums_failed_requests_over_the_runs():
    run = {"output_throughput": 100.0, "median_itl_ms": 50.0, "failed": 0}
    runs = {"llama.cpp": [run, {**run, "failed": 3}, run], "kiln": [{**run, "output_throughput": 120.0}] * 3}
    rows = {line.split("|")[1].strip(): line.replace(" ", "") for line in table(runs).splitlines()[2:]}
    assert rows["output tok/s"].endswith("|100.0|120.0|1.20x|")
    assert rows["failed requests, all runs"].endswith("|3|0|-|")  # (a median would hide the failed run)
