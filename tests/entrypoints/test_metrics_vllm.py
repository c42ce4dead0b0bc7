"""vLLM's per-step and per-request metrics, and the Grafana dashboard's queries against /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from engine.entrypoints.openai.metrics import EngineMetrics
from tests.support.engine import assert_engine_clean, served

DASHBOARD = Path(__file__).resolve().parents[2] / "engine" / "entrypoints" / "openai" / "grafana_dashboard.json"


def _samples(metrics: EngineMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples, name: str) -> float:
    return sum(s.value for s in samples[name])


def _drive(engine, metrics: EngineMetrics) -> None:
    while engine.core.has_unfinished_requests():
        outs = engine.step()
        metrics.on_step(engine, outs, time.monotonic())
        engine.core.check_integrity()


def test_request_histograms_follow_the_engine(make_llm):
    llm = make_llm(max_num_seqs=4)
    engine = llm.engine
    metrics = EngineMetrics("tiny", log_stats_interval=0)
    metrics.set_engine_info(engine)
    prompts = [list(range(10, 20)), list(range(30, 47)), list(range(60, 65))]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind="delta"),
        SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=9, ignore_eos=True, output_kind="delta"),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind="delta"),
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, f"r{i}")
    _drive(engine, metrics)
    assert_engine_clean(engine)
    m = _samples(metrics)
    assert _value(m, "kiln:request_prompt_tokens_count") == 3
    assert _value(m, "kiln:request_prompt_tokens_sum") == 10 + 17 + 5
    assert _value(m, "kiln:request_generation_tokens_sum") == 6 + 2 * 9 + 3
    assert _value(m, "kiln:request_max_num_generation_tokens_sum") == 6 + 9 + 3
    assert _value(m, "kiln:request_params_n_sum") == 4
    assert _value(m, "kiln:request_params_max_tokens_sum") == 18
    for name in ("prefill", "decode", "inference"):
        assert _value(m, f"kiln:request_{name}_time_seconds_count") == 3
    assert _value(m, "kiln:request_inference_time_seconds_sum") >= _value(m, "kiln:request_decode_time_seconds_sum")
    assert (
        _value(m, "kiln:iteration_tokens_total_sum")
        == engine.core.num_prompt_tokens_total + engine.core.num_generation_tokens_total
    )
    (info,) = m["kiln:cache_config_info"]
    assert info.labels["block_size"] == str(engine.settings.block_size)
    assert info.labels["num_gpu_blocks"] == str(engine.core.pool.num_usable) and info.value == 1
    (lora,) = m["kiln:lora_requests_info"]
    assert lora.labels["running_lora_adapters"] == "" and lora.labels["max_lora"] == "0"


def test_spec_decode_num_drafts(make_llm):
    llm = make_llm(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    engine = llm.engine
    metrics = EngineMetrics("tiny", log_stats_interval=0)
    engine.add_request(
        [7, 8, 9, 10] * 8, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind="delta"), "s"
    )
    _drive(engine, metrics)
    m = _samples(metrics)
    drafts = _value(m, "kiln:spec_decode_num_drafts_total")
    assert drafts == engine.core.scheduler.num_drafts > 0
    assert _value(m, "kiln:spec_decode_num_draft_tokens_total") >= drafts


def _dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 20
    return {name for e in exprs for name in re.findall(r"kiln:[a-zA-Z0-9_]+", e)}


def test_every_dashboard_query_uses_an_exported_metric(tiny_llama):
    async def run():
        with served(tiny_llama) as (state, http, client):
            r = await http.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 200
            return (await http.get("/metrics")).text

    text = asyncio.run(run())
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = sorted(_dashboard_metric_names() - exported)
    assert not missing, f"dashboard queries metrics /metrics does not export: {missing}"
    vllm_dashboard = Path(__file__).resolve().parents[1] / "data" / "vllm_dashboard_series.txt"
    queried = [
        line.strip().replace("vllm:", "kiln:", 1)
        for line in vllm_dashboard.read_text().splitlines()
        if line.startswith("vllm:")
    ]
    assert len(queried) >= 20 and not sorted(set(queried) - exported), sorted(set(queried) - exported)
    for name in (
        "kiln:iteration_tokens_total_bucket",
        "kiln:request_prompt_tokens_bucket",
        "kiln:request_generation_tokens_bucket",
        "kiln:request_prefill_time_seconds_bucket",
        "kiln:request_decode_time_seconds_bucket",
        "kiln:request_inference_time_seconds_bucket",
        "kiln:request_max_num_generation_tokens_bucket",
        "kiln:request_params_n_bucket",
        "kiln:request_params_max_tokens_bucket",
        "kiln:cache_config_info",
        "kiln:lora_requests_info",
        "kiln:spec_decode_num_drafts_total",
    ):
        assert name in exported, name
