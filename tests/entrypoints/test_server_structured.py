"""The served OpenAI API's constrained outputs: response_format (JSON schema, JSON object), vLLM's
structured-output fields, streamed and not, tool calls with a named or required tool_choice, and
the 400s for constraints and tool requests it cannot serve. (The shared server: conftest.py.)
"""

from __future__ import annotations

import json
import re

import pytest

from tests.support.openai_http import error_body, post
from tests.support.server import MODEL

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "pet"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
}


def test_response_format_json_schema_and_json_object(client):
    import jsonschema

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=200,
        temperature=0.7,
        seed=3,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"structured_outputs": None},
    )
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content, strict=False), PERSON)
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content, strict=False), dict)
    text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format={"type": "text"}
    )
    assert text.choices[0].message.content is not None


def test_vllm_structured_output_fields_and_streaming(client):
    choices = ["alpha", "beta", "gamma delta"]
    r = client.completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=20,
        temperature=1.0,
        n=3,
        seed=5,
        extra_body={"guided_choice": choices},
    )
    assert {c.text for c in r.choices} <= set(choices) and all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(
        model=MODEL,
        prompt="A code:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    pieces = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a list"}],
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"guided_grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+'},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    text = "".join(pieces)
    assert re.fullmatch(r"\[[a-z]+(,[a-z]+)*\]", text) or re.fullmatch(r"\[[a-z]+(,[a-z]+)*,?[a-z]*", text), text


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"guided_regex": "(open"}, "guided_regex", "does not compile"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}},
            "guided_json",
            "does not compile",
        ),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "not several"),
        ({"structured_outputs": {"shape": "round"}}, "structured_outputs", "shape"),
    ],
)
def test_bad_structured_output_constraints_400(url, body, param, message):
    err = error_body(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body}), 400)
    assert err["param"] == param and message in err["message"], err


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "days"],
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"enum": ["UTC"]}},
        },
    },
}


def test_named_and_required_tool_choice(client):
    import jsonschema

    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=150,
        temperature=0.7,
        seed=2,
        tools=[WEATHER_TOOL, TIME_TOOL],
    )
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **ask)
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's behaviour for a named call
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    streamed_args, names, finish = "", set(), None
    for chunk in client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **ask
    ):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names.add(tc.function.name)
            streamed_args += tc.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert names - {None} == {"get_weather"} and streamed_args == call.function.arguments and finish == "stop"

    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **ask)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize(
    "extra,param,message",
    [
        ({"tools": [WEATHER_TOOL]}, "tool_choice", "enable-auto-tool-choice"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"},
            "tools.0.function.name",
            "",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/gone"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "does not compile",
        ),
    ],
)
def test_bad_tool_requests_400(url, extra, param, message):
    err = error_body(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra}), 400)
    assert err["param"] == param and message in err["message"], err
