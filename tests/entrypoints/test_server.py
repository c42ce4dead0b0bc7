"""The real server in a subprocess (`python -m engine.entrypoints.cli serve ...`), driven with the official
openai client: the OpenAI completions and chat APIs' basics, and their errors.

One server for every module of the served API (tests/entrypoints/conftest.py: this one, test_server_structured.py,
test_server_load.py, test_server_apis.py). After every test the server must be back to zero running, zero
waiting and zero KV blocks in use (read from /metrics).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.openai_http import error_body, post, sse_events
from tests.support.server import API_KEY, AUTH, MAX_MODEL_LEN, MODEL


# ------------------------------------------------------------------ basics
def test_models_health_version_tokenize(url):
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version", headers=AUTH).json()["version"]
    assert httpx.get(f"{url}/version").status_code == 401  # default-deny: only /health and /ping are open
    tok = post(url, "/tokenize", {"prompt": "Hello, world!"}).json()
    assert tok["count"] == len(tok["tokens"]) > 2
    detok = post(url, "/detokenize", {"tokens": tok["tokens"][1:]}).json()  # drop BOS
    assert detok["prompt"] == "Hello, world!"


def test_completion_non_streaming(client, url):
    n_prompt = post(url, "/tokenize", {"prompt": "The quick brown fox"}).json()["count"]
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + 7


def test_greedy_matches_offline_llm(client, make_llm):
    prompts = ["The quick brown fox", "Paged attention stores", "Hello"]
    llm = make_llm(max_model_len=MAX_MODEL_LEN, num_gpu_blocks=64)
    from engine.core.params import SamplingParams

    offline = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    for prompt, ref in zip(prompts, offline):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
        )
        choice = r.choices[0]
        assert choice.text == ref.outputs[0].text
        expected = [lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
        assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    # token-id prompts give the same thing as the text they encode
    ids = llm.tokenizer.encode(prompts[0])
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == offline[0].outputs[0].text


def test_streaming_completion_matches_non_streaming(client, url):
    args = dict(model=MODEL, prompt="A kiln is", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # The raw wire format: data lines, usage chunk, then [DONE]
    raw = post(
        url,
        "/v1/completions",
        {
            **{k: v for k, v in args.items() if k != "extra_body"},
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] > 10
    no_usage = sse_events(post(url, "/v1/completions", {"prompt": "A kiln is", "max_tokens": 3, "stream": True}))
    assert no_usage[-1] == "[DONE]" and all("usage" not in e for e in no_usage[:-1])
    running = sse_events(
        post(
            url,
            "/v1/completions",
            {
                "prompt": "A kiln is",
                "max_tokens": 4,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
    )
    counts = [e["usage"]["completion_tokens"] for e in running[:-2] if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4 and running[-2]["usage"]["completion_tokens"] == 4


def test_truncate_prompt_tokens(client):
    long = "the quick brown fox jumps over the lazy dog " * 200  # far beyond max_model_len
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 100})
    assert r.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"truncate_prompt_tokens": 0})


def test_chat_non_streaming_and_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == r.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n2_seed_and_chat_logprobs(client):
    args = dict(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0, n=2, seed=7, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 16
    streamed = list(client.completions.create(stream=True, **args))
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert [by_index[0], by_index[1]] == [c.text for c in a.choices]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        n=2,
        temperature=0.8,
        seed=1,
    )
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert 1 <= len(choice.logprobs.content) <= 4
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3


def test_stop_strings_and_max_tokens(client):
    args = dict(model=MODEL, prompt="The quick brown fox", temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(max_tokens=30, **args).choices[0].text
    stop = base[8:10]
    assert stop.strip(), base
    cut = base[: base.index(stop)]
    r = client.completions.create(max_tokens=30, stop=[stop, "never-there"], **args)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(max_tokens=30, stop=stop, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    short = client.completions.create(max_tokens=2, **args)
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"


def test_echo_and_prompt_lists(client):
    r = client.completions.create(
        model=MODEL,
        prompt=["Hello", "A kiln"],
        max_tokens=3,
        temperature=0,
        echo=True,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Hello") and r.choices[2].text.startswith("A kiln")
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples agree
    assert r.usage.completion_tokens == 12


def test_echo_logprobs_score_the_prompt(client, url):
    """echo + logprobs (what loglikelihood evaluations send): the echoed prompt tokens carry the
    logprobs that generating them would have had; the first has none."""
    prompt = [40, 41, 42, 43, 44, 45]
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    token_lp = gen.choices[0].logprobs.token_logprobs[0]
    next_id = post(url, "/tokenize", {"prompt": gen.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    scored = client.completions.create(
        model=MODEL, prompt=prompt + next_id[:1], max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    if len(next_id) == 1:  # the generated text re-tokenises to the generated token
        assert abs(lp.token_logprobs[len(prompt)] - token_lp) < 1e-4
    stream = client.completions.create(
        model=MODEL, prompt=prompt + next_id[:1], max_tokens=1, temperature=0, logprobs=2, echo=True, stream=True
    )
    first = next(iter(stream)).choices[0].logprobs
    # Tokens exactly, logprobs to 1e-4: each request's batch forms as requests arrive (another
    # test's aborted stream may still be running), and another batch shape may take another matmul path.
    assert first.tokens[: len(prompt) + 1] == lp.tokens[: len(prompt) + 1]
    assert first.token_logprobs[: len(prompt) + 1] == pytest.approx(lp.token_logprobs[: len(prompt) + 1], abs=1e-4)
    # max_tokens=0 with echo: the prompt scored, nothing generated (and without echo: 400)
    only = client.completions.create(model=MODEL, prompt=prompt + next_id[:1], max_tokens=0, logprobs=2, echo=True)
    assert only.choices[0].logprobs.tokens == lp.tokens[: len(prompt) + 1]
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[: len(prompt) + 1], abs=1e-4)
    assert (
        only.usage.completion_tokens == 0
        and only.choices[0].text == scored.choices[0].text[: len(only.choices[0].text)]
    )
    no_echo = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0})
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"
    # vLLM's prompt_logprobs extension gives the same numbers
    body = post(
        url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
    ).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    assert [e[str(t)]["logprob"] for t, e in zip(prompt[1:], entries[1:])] == pytest.approx(
        lp.token_logprobs[1 : len(prompt)], abs=1e-4
    )


def test_logit_bias_and_allowed_token_ids(client, url):
    forced = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == post(url, "/detokenize", {"tokens": [42, 42, 42]}).json()["prompt"]
    only = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        temperature=1.0,
        seed=1,
        logprobs=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": [50, 51]},
    )
    allowed = {post(url, "/detokenize", {"tokens": [t]}).json()["prompt"] for t in (50, 51)}
    assert len(only.choices[0].logprobs.tokens) == 6 and set(only.choices[0].logprobs.tokens) <= allowed
    bad = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {"99999999": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias", bad.text


def test_prefix_cache_reports_cached_tokens(client):
    prompt = "Continuous batching lets new requests join a running batch at every step instead of waiting. " * 2
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 10)}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"temperature": 0.5}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ],
)
def test_invalid_parameters_400(url, path, body, param):
    err = error_body(post(url, path, body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert "pydantic" not in err["message"] and "errors.pydantic" not in err["message"]


def test_error_statuses(url, client):
    assert error_body(post(url, "/v1/completions", b'{"prompt": "hi",'), 400)["message"].find("not valid JSON") >= 0
    err = error_body(post(url, "/v1/completions", {"prompt": "hi"}, key=None), 401)
    assert err["type"] == "authentication_error"
    error_body(post(url, "/v1/completions", {"prompt": "hi"}, key="wrong"), 401)
    error_body(httpx.get(f"{url}/v1/models"), 401)
    err = error_body(post(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    error_body(httpx.get(f"{url}/no/such/route", headers=AUTH), 404)
    error_body(httpx.get(f"{url}/no/such/route"), 401)
    # The openai client maps them to its exception types
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # Unknown fields are ignored; the server keeps serving.
    ok = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": True, "logit_bias": {}})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_request_id_echoed_or_generated(url):
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r2 = httpx.get(f"{url}/health")
    assert len(r2.headers["x-request-id"]) >= 16
