"""The Messages API (Anthropic's) and the Responses API (OpenAI's) against the served tiny model,
driven with the official `anthropic` and `openai` SDKs. Each answer is checked against the chat
route's answer to the same conversation (greedy: token for token), so the translation is what
is tested, on the server the OpenAI tests use (tests/entrypoints/conftest.py)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.server import API_KEY, MODEL

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}},
    },
}
SYSTEM = "You are terse."
# (The anthropic SDK takes sampling settings as extra fields: its create() has no temperature.)
GREEDY = {"temperature": 0}
ASK = "Say something about the sea"


@pytest.fixture
def claude(url):
    # (In the test extras; a venv made before it was added skips these until it is reinstalled.)
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def chat_answer(client, messages: list[dict], **kw):
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return out.choices[0], out.usage


# ---- /v1/messages ----
def test_messages_plain_matches_chat(claude, client):
    msg = claude.messages.create(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=12, extra_body=GREEDY
    )
    choice, usage = chat_answer(
        client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=12
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == choice.message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert msg.usage.output_tokens == usage.completion_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == usage.prompt_tokens

    # top_k=1 samples greedily at any temperature; content blocks read as text.
    blocks = claude.messages.create(
        model=MODEL,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        max_tokens=12,
        extra_body={"temperature": 1.0, "top_k": 1},
    )
    assert blocks.content[0].text == msg.content[0].text

    # A stop sequence taken from the answer ends it there.
    text = msg.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = claude.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=12,
        extra_body=GREEDY,
        stop_sequences=[stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_messages_streamed_events(claude):
    ask = dict(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=12, extra_body=GREEDY
    )
    whole = claude.messages.create(**ask)
    events = list(claude.messages.create(stream=True, **ask))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == 12

    with claude.messages.stream(**ask) as stream:  # the SDK's own accumulation
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_messages_tool_use_and_result(claude, client):
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=100,
        extra_body=GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    msg = claude.messages.create(**ask)
    assert msg.stop_reason == "tool_use", msg
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # The chat route, asked for the same named call, writes the same arguments.
    choice, _ = chat_answer(
        client,
        ask["messages"],
        max_tokens=100,
        tools=[
            {
                "type": "function",
                "function": {**{k: WEATHER[k] for k in ("name", "description")}, "parameters": WEATHER["input_schema"]},
            }
        ],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(choice.message.tool_calls[0].function.arguments, strict=False) == call.input

    # Streamed, the arguments come as they are written: input_json_delta pieces adding up to them.
    events = list(claude.messages.create(stream=True, **ask))
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input, pieces
    with claude.messages.stream(**ask) as stream:  # the SDK's own accumulation (a partial parse per piece)
        streamed = stream.get_final_message()
    (scall,) = [b for b in streamed.content if b.type == "tool_use"]
    assert scall.input == call.input and streamed.stop_reason == "tool_use"

    # The next turn: the tool's result goes back as a tool_result block.
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            *ask["messages"],
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
        ],
    )
    assert answer.content and answer.content[0].type == "text"
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > msg.usage.input_tokens


def test_messages_count_tokens_is_the_prompt_messages_runs(claude):
    import anthropic

    for ask in (
        dict(system=SYSTEM, messages=[{"role": "user", "content": ASK}]),
        dict(
            tools=[WEATHER],
            tool_choice={"type": "none"},
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]},
            ],
        ),
    ):
        counted = claude.messages.count_tokens(model=MODEL, **ask)
        ran = claude.messages.create(model=MODEL, max_tokens=1, **ask).usage
        assert counted.input_tokens == ran.input_tokens + ran.cache_read_input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.count_tokens(model="nope", messages=[{"role": "user", "content": ASK}])
    assert unknown.value.body["type"] == "error"  # (Anthropic's error shape on this route too)


def test_messages_errors_in_anthropic_shape(url, claude):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert bad_key.value.body["type"] == "error" and bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    resp = httpx.post(
        f"{url}/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]}, headers={"x-api-key": API_KEY}
    )
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="only text parts"):
        claude.messages.create(model=MODEL, messages=[{"role": "user", "content": [image]}], max_tokens=4)


# ---- /v1/responses ----
WEATHER_FUNCTION = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}


def test_responses_plain_matches_chat(client, url):
    resp = client.responses.create(model=MODEL, instructions=SYSTEM, input=ASK, max_output_tokens=12, temperature=0)
    choice, usage = chat_answer(
        client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=12
    )
    assert resp.object == "response" and resp.output_text == choice.message.content
    assert resp.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert [item.type for item in resp.output] == ["message"] and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == usage.prompt_tokens and resp.usage.output_tokens == usage.completion_tokens
    # A list of message items, with input_text parts, is the same conversation.
    items = client.responses.create(
        model=MODEL,
        input=[
            {"role": "system", "content": SYSTEM},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        ],
        max_output_tokens=12,
        temperature=0,
    )
    assert items.output_text == resp.output_text
    # Stored: read back with the same key, then deleted.
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    by_x_api_key = httpx.get(f"{url}/v1/responses/{resp.id}", headers={"x-api-key": API_KEY})  # the same key
    assert by_x_api_key.json()["output"][0]["content"][0]["text"] == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_responses_streamed_events(client):
    ask = dict(model=MODEL, instructions=SYSTEM, input=ASK, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(stream=True, **ask))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulation checks each event against the snapshot it builds (its
    # get_final_response wants response.completed; a 12-token answer of the tiny model is incomplete).
    with client.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text


def test_responses_function_call_and_previous_response(client):
    first = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER_FUNCTION],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["input_schema"])

    ask = dict(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER_FUNCTION],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        temperature=0,
    )
    events = list(client.responses.create(stream=True, **ask))
    # The arguments stream as they are written, and add up to the whole answer's, exactly.
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and len(deltas) > 1 and "".join(deltas) == done[0].arguments == call.arguments
    assert events[-1].response.output[0].type == "function_call"
    assert events[-1].response.output[0].arguments == call.arguments
    with client.responses.stream(**ask) as stream:  # the SDK's own accumulation
        snapshots = [e.snapshot for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert snapshots[-1] == call.arguments and final.output[0].arguments == call.arguments

    # The next turn sends the call's output after the stored turn: the same as the chat route
    # given the whole conversation.
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER_FUNCTION],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    choice, usage = chat_answer(
        client,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        max_tokens=8,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}],
        tool_choice="none",
    )
    assert second.output_text == choice.message.content and second.usage.input_tokens == usage.prompt_tokens

    # A turn that was not stored cannot be continued.
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="more", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
