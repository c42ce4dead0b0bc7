"""Large request bodies (issue 39, third round): string values and arrays counted before parsing,
validation on the JSON thread in pieces that rest (engine/entrypoints/openai/json_thread.py), and
tool definitions bounded in size and depth before they are validated, on every API that takes
tools."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from engine.core.admission_rules import MAX_TOOL_DEPTH, MAX_TOOL_VALUES, MAX_TOOLS_VALUES
from engine.entrypoints.openai import json_thread, request_body
from engine.entrypoints.openai.request_body import JSONValueCounter
from tests.support.server import app_states


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=128, num_gpu_blocks=64, max_num_seqs=2)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)


def test_string_values_and_arrays_are_counted_before_parsing(app_state):
    """Strings, arrays and literals are what json's C parser builds with no point for the JSON
    thread to rest at: past max_request_json_strings (string values, arrays, true/false/null;
    object keys, which come with a value that rests, not counted) a body is a 400 before it is
    parsed."""
    body = json.dumps({"stop": ["a,:[{", "b"], "k": {"x": "y", "z": [1, [2], True, None]}, "f": False}).encode()
    for size in (1, 2, 3, 7, len(body)):  # (chunk boundaries anywhere)
        counter = JSONValueCounter()
        for i in range(0, len(body), size):
            counter.feed(body[i : i + size])
        assert counter.unrested == 3 + 3 + 3, (size, counter.unrested)

    state, app = app_state(server={"max_request_json_strings": 1000})

    def stops(n: int) -> dict:  # n + 1 string values and one array
        return {"prompt": "hi", "max_tokens": 1, "stop": ["s"] * n}

    keyed = {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1.0 for i in range(5000)}}

    async def main():
        async with _client(app) as http:
            return [await http.post("/v1/completions", json=body) for body in (stops(998), stops(999), keyed)]

    at_bound, over, many_keys = asyncio.run(main())
    assert at_bound.status_code == 200, at_bound.text
    assert over.status_code == 400 and "max_request_json_strings=1000" in over.text, over.text
    assert "max_request_json_strings" not in many_keys.text, many_keys.text


def test_large_bodies_are_validated_on_the_json_thread(app_state, monkeypatch):
    """A large body's validation runs on the JSON thread, item by item, and gives what FastAPI's
    would: 200 for a valid one, the same 400 (message and field) as the small body's for an
    invalid one."""
    state, app = app_state()
    threads = []
    real = json_thread.validate
    monkeypatch.setattr(json_thread, "validate", lambda *a: threads.append(threading.current_thread().name) or real(*a))
    filler = "x" * request_body.OFF_LOOP_BYTES
    messages = [{"role": "system", "content": "be brief"}] * 3 + [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(3)]

    async def main():
        async with _client(app) as http:
            big = {"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 2, "user": filler}
            ok = await http.post("/v1/chat/completions", json=big)
            bad = [*messages[:2], {"role": "user", "content": 5}]
            invalid_big = await http.post("/v1/chat/completions", json={**big, "messages": bad})
            invalid_small = await http.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 2})
            return ok, invalid_big, invalid_small

    ok, invalid_big, invalid_small = asyncio.run(main())
    assert ok.status_code == 200, ok.text
    assert invalid_big.status_code == 400 and invalid_big.json() == invalid_small.json(), invalid_big.text
    assert invalid_big.json()["error"]["param"] == "messages.2.content", invalid_big.text
    assert threads and all(t.startswith("kiln-json") for t in threads), threads


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_tool_definitions_are_bounded_in_size_and_depth(app_state, api):
    state, app = app_state()

    def tool(name: str, schema: dict) -> dict:
        if api == "chat":
            return {"type": "function", "function": {"name": name, "parameters": schema}}
        if api == "responses":
            return {"type": "function", "name": name, "parameters": schema}
        return {"name": name, "input_schema": schema}

    def body(tools: list) -> tuple[str, dict]:
        hi = [{"role": "user", "content": "hi"}]
        if api == "chat":
            return "/v1/chat/completions", {"messages": hi, "max_tokens": 2, "tools": tools, "tool_choice": "none"}
        if api == "responses":
            return "/v1/responses", {"input": "hi", "max_output_tokens": 2, "tools": tools, "tool_choice": "none"}
        return "/v1/messages", {"max_tokens": 2, "messages": hi, "tools": tools, "tool_choice": {"type": "none"}}

    wide = {"type": "object", "enum": list(range(MAX_TOOL_VALUES))}  # (over the bound with the tool around it)
    share = {"type": "object", "enum": list(range(MAX_TOOL_VALUES // 2))}
    cases = {
        "deep": ([tool("ok", _nested(2)), tool("deep", _nested(MAX_TOOL_DEPTH))], "tools[1]", "levels deep"),
        "wide": ([tool("wide", wide)], "tools[0]", f"more than {MAX_TOOL_VALUES} JSON values"),
        "in all": (
            [tool(f"t{i}", share) for i in range(MAX_TOOLS_VALUES // (MAX_TOOL_VALUES // 2))],
            "tools",
            "together",
        ),
    }

    async def main():
        async with _client(app) as http:
            answers = {}
            for name, (tools, _, _) in cases.items():
                path, data = body(tools)
                answers[name] = await http.post(path, json=data)
            path, data = body([tool("fine", _nested(8))])
            answers["fine"] = await http.post(path, json=data)
            return answers

    answers = asyncio.run(main())
    for name, (_, param, message) in cases.items():
        resp = answers[name]
        assert resp.status_code == 400, (name, resp.text)
        text = resp.text
        assert message in text and param in text, (name, text)
    assert answers["fine"].status_code == 200, answers["fine"].text


def test_every_body_taking_route_reads_its_body_with_the_bounds(app_state):
    """Count limits, the JSON thread and validation in pieces apply to every body kiln accepts
    (Responses and Messages included), and to routes added later: each route that takes a body
    is a BoundedJSONRoute, and each single-model one validates large bodies there."""
    from fastapi.routing import APIRoute

    state, app = app_state()

    def api_routes(routes):  # (through FastAPI's included routers)
        for route in routes:
            inner = getattr(route, "original_router", None)
            yield from api_routes(inner.routes) if inner is not None else [route]

    taking = [r for r in api_routes(app.routes) if isinstance(r, APIRoute) and r.body_field is not None]
    paths = {r.path for r in taking}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings"} <= paths
    assert {"/tokenize", "/detokenize", "/v1/messages/count_tokens"} <= paths, paths
    assert [r.path for r in taking if not isinstance(r, request_body.BoundedJSONRoute)] == []
    assert [r.path for r in taking if len(r.dependant.body_params) != 1 or r._embed_body_fields] == []
