"""Tool calling: the auto parsers hermes and llama3_json on their own (the others:
test_tool_parsers.py), and the whole path in process with the official openai client (auto
mode: a constraint makes the tiny random model write a call in the parser's format)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from engine.core.admission_rules import InvalidRequestError
from engine.entrypoints.openai.tool_calls import (
    ToolMode,
    arguments_for_template,
    parse_hermes,
    parse_llama3_json,
    resolve_tool_mode,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


# ---------------------------------------------------------------- parsers
def test_hermes_finds_calls_and_keeps_the_text_before_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_hermes_leaves_anything_else_as_content(text):
    assert parse_hermes(text) == (text, [])


def test_hermes_call_cut_short_after_its_json_still_parses():
    content, calls = parse_hermes('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}


def test_llama3_json_single_several_and_python_tag():
    _, calls = parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    _, calls = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 2}}')
    assert [c.name for c in calls] == ["a", "b"] and json.loads(calls[1].arguments) == {"x": 2}
    for text in ("Hello there", '{"name": "a", "parameters": {}} trailing words', '{"no_name": 1}', "{broken"):
        assert parse_llama3_json(text) == (text, [])


def test_streamable_prefix_holds_back_what_may_be_a_call():
    hermes = ToolMode("auto", {}, parser="hermes")
    assert hermes.streamable("Hello") == 5
    assert hermes.streamable("Hello <tool") == len("Hello")  # (the space too: content before a call is stripped)
    assert hermes.streamable("Hello <tool_call>{") == len("Hello")
    assert hermes.streamable("a < b") == len("a < b")
    llama = ToolMode("auto", {}, parser="llama3_json")
    assert llama.streamable('  {"name') == 0 and llama.streamable("<|pyth") == 0 and llama.streamable("") == 0
    assert llama.streamable("Sure, here") == len("Sure, here")
    assert ToolMode("required", {}).streamable("[{") == 0


def test_resolve_tool_mode_and_its_errors():
    assert resolve_tool_mode(None, None, None).kind == "none"
    assert resolve_tool_mode([WEATHER], "none", None).kind == "none"
    named = resolve_tool_mode([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert (named.kind, named.name) == ("named", "get_time")
    assert named.constraint(True).json == TIME["function"]["parameters"]
    required = resolve_tool_mode([WEATHER, TIME], "required", None).constraint(parallel=False)
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    assert resolve_tool_mode([WEATHER], None, "hermes").kind == "auto"
    for tools, choice, match in [
        ([WEATHER], None, "enable-auto-tool-choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (None, "required", "needs tools"),
        ([WEATHER, WEATHER], "required", "used twice"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            resolve_tool_mode(tools, choice, None)


def test_required_output_that_does_not_parse_stays_content():
    mode = ToolMode("required", {"f": {}})
    assert mode.calls('[{"name": "f", "param') == ('[{"name": "f", "param', [])
    content, calls = mode.calls('[{"name": "f", "parameters": {"k": "v"}}]')
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"k": "v"}


def test_tool_call_arguments_become_mappings_for_templates():
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    out = arguments_for_template(calls)
    assert out[0]["function"]["arguments"] == {"a": 1} and out[1]["function"]["arguments"] == "not json"
    assert calls[0]["function"]["arguments"] == '{"a": 1}'  # the request itself is left alone


# ---------------------------------------------------------------- auto mode, whole path
HERMES_CALL = (
    r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
    r'"days": [1-7]\}\}\n</tool_call>'
)
LLAMA_CALL = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'


@pytest.fixture
def auto_server(tiny_llama):
    from tests.support.engine import served

    with contextlib.ExitStack() as stack:
        yield lambda parser: stack.enter_context(
            served(tiny_llama, {"enable_auto_tool_choice": True, "tool_call_parser": parser})
        )[2]


def test_auto_hermes_calls_non_streaming_and_streaming(auto_server):
    client = auto_server("hermes")
    ask = dict(
        model="m",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER, TIME],
        max_tokens=200,
        temperature=0.8,
        seed=1,
        extra_body={"guided_regex": HERMES_CALL},
    )

    async def main():
        r = await client.chat.completions.create(**ask)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.type == "function"
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7

        content, calls, finish = "", {}, None
        async for chunk in await client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                calls.setdefault(tc.index, {"id": tc.id, "name": "", "pieces": []})
                calls[tc.index]["name"] += tc.function.name or ""
                calls[tc.index]["pieces"].append(tc.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        assert "<tool_call>" not in content and content.strip() == "Checking."
        assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"]
        # The arguments come as they are written (OpenAI's stream), adding up to the whole answer's.
        assert len([p for p in calls[0]["pieces"] if p]) > 3, calls
        assert "".join(calls[0]["pieces"]) == call.function.arguments  # same seed, same call

        plain = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER],
            max_tokens=5,
            temperature=0,
            extra_body={"guided_regex": "[a-z ]{5}"},
        )
        assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].finish_reason != "tool_calls"

    asyncio.run(main())


def test_auto_llama3_json_and_a_follow_up_turn_with_the_tool_result(auto_server):
    client = auto_server("llama3_json")

    async def main():
        r = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Time?"}],
            tools=[TIME],
            max_tokens=120,
            temperature=0,
            extra_body={"guided_regex": LLAMA_CALL},
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_time"
        follow = await client.chat.completions.create(
            model="m",
            max_tokens=5,
            tools=[TIME],
            tool_choice="none",
            messages=[
                {"role": "user", "content": "Time?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
            ],
        )
        assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls

    asyncio.run(main())


QWEN3_XML_CALL = (
    r"Let me see\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
    r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>"
)


def test_auto_qwen3_coder_typed_arguments_streamed_and_not(auto_server):
    """A parser from tool_parsers/ end to end: the XML values come back typed by the tool's
    schema (days an integer), and the stream's content and calls match the whole answer's."""
    client = auto_server("qwen3_coder")
    ask = dict(
        model="m",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        max_tokens=120,
        temperature=0.8,
        seed=3,
        extra_body={"guided_regex": QWEN3_XML_CALL},
    )

    async def main():
        r = await client.chat.completions.create(**ask)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome")
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7

        content, names, arguments, finish = "", [], [], None
        async for chunk in await client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            names += [tc.function.name for tc in delta.tool_calls or [] if tc.function.name]
            arguments += [tc.function.arguments for tc in delta.tool_calls or []]
            finish = chunk.choices[0].finish_reason or finish
        assert content == "Let me see." and finish == "tool_calls"
        # (days is typed by its schema: it goes once it has ended; city, a string, as it is written)
        assert names == ["get_weather"] and "".join(arguments) == call.function.arguments

    asyncio.run(main())
