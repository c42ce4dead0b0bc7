"""generation_config.json: sampling defaults applied (request fields win), extra EOS ids stop generation."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from engine.config.generation_config import load_generation_defaults
from engine.core.params import SamplingParams
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.engine import served

PROMPT = [5, 9, 100, 200, 7]


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_models, tmp_path_factory):
    """The tiny llama plus a generation_config.json whose extra EOS id is the 3rd token greedy
    decoding of PROMPT produces (so generation must stop there)."""
    from engine.entrypoints.llm import LLM

    src = tiny_models["llama"]
    llm = LLM(str(src), device="cpu", enforce_eager=True, generation_config="vllm")
    tokens = (
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    dst = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(src, dst)
    eos = json.loads((src / "config.json").read_text()).get("eos_token_id")
    (dst / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "do_sample": True, "eos_token_id": [eos, tokens[stop_at]]}
        )
    )
    return dst, tokens, stop_at


def test_defaults_read_and_vllm_ignores_them(model_with_generation_config):
    model, tokens, stop_at = model_with_generation_config
    defaults = load_generation_defaults(model)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}
    assert tokens[stop_at] in defaults.eos_token_ids
    assert load_generation_defaults(model, "vllm").sampling == {}
    assert load_generation_defaults(model, str(model)).sampling == defaults.sampling
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_defaults(model, str(model / "nope"))


def test_request_fields_override_the_defaults(model_with_generation_config):
    defaults = load_generation_defaults(model_with_generation_config[0])
    body = CompletionRequest.model_validate({"prompt": "hi"})
    params = body.sampling_params(defaults=defaults)
    assert (params.temperature, params.top_p) == (0.6, 0.9)
    body = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.0})
    params = body.sampling_params(defaults=defaults)
    assert (params.temperature, params.top_p) == (0.0, 0.9)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_p": 0.5})
    params = body.sampling_params(defaults=defaults)
    assert (params.temperature, params.top_p) == (0.6, 0.5)


def test_offline_defaults_and_extra_eos(make_llm, model_with_generation_config):
    model, tokens, stop_at = model_with_generation_config
    llm = make_llm(model)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, -1)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: stop_at + 1]
    # --generation-config vllm: the extra EOS is not a stop token.
    plain = make_llm(model, generation_config="vllm")
    out = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > stop_at + 1 and plain.get_default_sampling_params().temperature == 1.0


def test_server_applies_defaults_and_stops_at_extra_eos(model_with_generation_config):
    model, tokens, stop_at = model_with_generation_config

    async def run():
        with served(model) as (state, http, client):
            r = await http.post(
                "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            )
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert r.json()["usage"]["completion_tokens"] == stop_at + 1

    asyncio.run(run())


def test_max_logprobs_bounds_requests(make_llm):
    from engine.core.admission_rules import InvalidRequestError

    llm = make_llm(max_logprobs=2)
    with pytest.raises(InvalidRequestError, match="max_logprobs"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= 2
