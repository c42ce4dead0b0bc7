"""Request bodies as the routes read them: parsed once (unknown fields logged there, once), and
the Messages and Responses APIs' bodies written as the chat request they ask for."""

from __future__ import annotations

import logging

from engine.entrypoints.openai.anthropic_protocol import MessagesRequest
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.responses_protocol import ResponsesRequest


def test_unknown_fields_are_logged_once_as_the_body_is_parsed(caplog):
    with caplog.at_level(logging.INFO, logger="engine.entrypoints.openai"):
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi", "mood": 1}], "frobnicate": True, "zeta": 2}
        )
        body.sampling_params()
        body.conversation()
    lines = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert lines == ["ignoring unknown request fields: frobnicate, zeta"]


def test_messages_body_as_chat():
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 7,
            "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"],
            "top_k": 3,
            "metadata": {"user_id": "u1"},
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "call f"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
    )
    chat = body.as_chat()
    assert chat.max_tokens == 7 and chat.stop == ["\n\n"] and chat.top_k == 3 and chat.user == "u1"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters["properties"] == {"a": {"type": "integer"}}
    assert chat.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "call f"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "t1"},
        {"role": "user", "content": "thanks"},
    ]
    named = MessagesRequest.model_validate({**body.model_dump(), "tool_choice": {"type": "tool", "name": "f"}})
    assert named.as_chat().tool_choice.function.name == "f"


def test_responses_items_as_chat():
    earlier = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
    ]
    body = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                {"type": "function_call_output", "call_id": "c2", "output": "sun"},
            ],
            "max_output_tokens": 5,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "tool_choice": {"type": "function", "name": "w"},
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        }
    )
    chat = body.as_chat(earlier)
    assert chat.max_tokens == 5 and chat.tool_choice.function.name == "w"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}
    calls = [
        {"id": c, "type": "function", "function": {"name": "w", "arguments": {"city": city}}}
        for c, city in (("c1", "Oslo"), ("c2", "Rome"))
    ]
    assert chat.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
        {"role": "tool", "content": "sun", "tool_call_id": "c2"},
    ]
    assert ResponsesRequest(input="hi").input_items() == [{"type": "message", "role": "user", "content": "hi"}]
