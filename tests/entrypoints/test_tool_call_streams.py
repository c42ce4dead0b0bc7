"""Tool-call arguments streamed as they are written, for every auto parser and through the
Responses and Messages streams (engine/entrypoints/openai/answer_blocks.py). Random arguments
(strings full of quotes, escapes, markers and non-ASCII; numbers; nested values) are written in
each parser's format and fed in random pieces: the pieces add up, exactly, to the non-streamed
arguments, and a string argument arrives while it is being written."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from engine.entrypoints.openai.answer_blocks import AnswerBlocks, json_text
from engine.entrypoints.openai.chat import chat_stream_delta
from engine.entrypoints.openai.jobs import Choice, Job
from engine.entrypoints.openai.messages import MessageEvents
from engine.entrypoints.openai.responses import ResponseEvents
from engine.entrypoints.openai.tool_calls import ToolMode
from engine.entrypoints.openai.tool_parsers import REGISTRY, TOOL_CALL_PARSERS
from engine.entrypoints.openai.tool_parsers.streaming import (
    CallInProgress,
    CanonicalJSON,
    StreamedCalls,
    canonical_prefix,
)

TYPES = {"text": "string", "note": "string", "count": "integer", "ratio": "number", "on": "boolean", "opts": "object"}
SCHEMAS = {"lookup": {"type": "object", "properties": {k: {"type": t} for k, t in TYPES.items()}}}
PIECES = ['"', "'", "\\", "\n", "\t", ",", ")", "]", "}", "{", "[", "=", "é", "漢", "😀", "<", ">", "/", "a", "b", " "]
MARKERS = ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|channel|>", "\\u00e9", "\\n"]


def random_text(rng: random.Random, n: int) -> str:
    out = "".join(rng.choice(PIECES) if rng.random() < 0.8 else rng.choice(MARKERS) for _ in range(n))
    return out.replace("</parameter>", "").replace("</arg_value>", "")  # (the XML formats' value ends)


def random_arguments(rng: random.Random) -> dict[str, Any]:
    args: dict[str, Any] = {"text": random_text(rng, rng.randint(0, 30))}
    if rng.random() < 0.7:
        args["count"] = rng.randint(-(10**6), 10**6)
    if rng.random() < 0.5:
        args["ratio"] = rng.choice([0.5, -1.25e-7, 3.0, 1e21])
    if rng.random() < 0.5:
        args["on"] = rng.random() < 0.5
    if rng.random() < 0.5:
        args["opts"] = {"k": [1, None, "x", {"y": random_text(rng, 5)}]}
    if rng.random() < 0.5:
        args["note"] = random_text(rng, rng.randint(1, 10))
    keys = list(args)
    rng.shuffle(keys)
    return {k: args[k] for k in keys}


def _py(value: Any, rng: random.Random) -> str:
    """A Python literal for value, spelled in one of the ways a model may write it."""
    if isinstance(value, str):
        return rng.choice([repr(value), json.dumps(value, ensure_ascii=False)])
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k, rng)}: {_py(v, rng)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v, rng) for v in value) + "]"
    return rng.choice(["true", "True"]) if value is True else repr(value)


def _xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


DS_BEGIN, DS_SEP = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_END, KIMI_END = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "<|tool_call_end|><|tool_calls_section_end|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"


def write_call(parser: str, args: dict[str, Any], rng: random.Random) -> str:
    """One call of `lookup` with these arguments, as the parser's model family writes it."""
    j = json.dumps(args, ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, 1]))
    if parser == "hermes":
        return f'Sure.\n<tool_call>\n{{"name": "lookup", "arguments": {j}}}\n</tool_call>'
    if parser in ("llama3_json", "llama4_json"):
        return f'{{"name": "lookup", "parameters": {j}}}'
    if parser == "granite":
        return f'<|tool_call|>[{{"name": "lookup", "arguments": {j}}}]'
    if parser == "internlm":
        return f'Ok.<|action_start|><|plugin|>{{"name": "lookup", "parameters": {j}}}<|action_end|>'
    if parser == "mistral":
        return f"[TOOL_CALLS]lookup[ARGS]{j}"
    if parser in ("pythonic", "llama4_pythonic"):
        py = "[lookup(" + ", ".join(f"{k}={_py(v, rng)}" for k, v in args.items()) + ")]"
        return f"<|python_start|>{py}<|python_end|>" if parser == "llama4_pythonic" else py
    if parser in ("qwen3_coder", "qwen3_xml"):
        params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
        return f"Let me see.\n<tool_call>\n<function=lookup>\n{params}</function>\n</tool_call>"
    if parser == "glm45":
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n" for k, v in args.items())
        return f"On it.\n<tool_call>lookup\n{pairs}</tool_call>"
    if parser == "deepseek_v3":
        return f"{DS_BEGIN}function{DS_SEP}lookup\n```json\n{j}\n```{DS_END}"
    if parser == "deepseek_v31":
        return f"{DS_BEGIN}lookup{DS_SEP}{j}{DS_END}"
    if parser == "kimi_k2":
        return f"<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0{KIMI_ARGS}{j}{KIMI_END}"
    assert parser == "openai"
    return f"<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{j}<|call|>"


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, len(text) // 2))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream_chat(mode: ToolMode, pieces: list[str]) -> list[dict]:
    """The chat route's deltas of an output fed in these pieces."""
    job = Job("id", "chat", [], 1, [None], None)
    job.tool_mode = mode
    ch = Choice()
    return [chat_stream_delta(job, ch, p, "stop" if i == len(pieces) - 1 else None)[0] for i, p in enumerate(pieces)]


def streamed_arguments(deltas: list[dict]) -> list[str]:
    """Per call index, its argument pieces."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for tc in delta.get("tool_calls", []):
            calls.setdefault(tc["index"], []).append(tc["function"].get("arguments", ""))
    return [calls[i] for i in sorted(calls)]


def test_every_parser_streams_arguments():
    assert all(REGISTRY[p].progress is not None for p in TOOL_CALL_PARSERS)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_random_arguments_in_random_pieces_add_up_to_the_whole_parse(parser):
    rng = random.Random(parser)
    mode = ToolMode("auto", SCHEMAS, parser=parser)
    for _ in range(15):
        args = random_arguments(rng)
        text = write_call(parser, args, rng)
        _, (call,) = REGISTRY[parser].parse(text, SCHEMAS)
        assert call.name == "lookup" and json.loads(call.arguments) == args, text
        for _ in range(2):
            (pieces,) = streamed_arguments(stream_chat(mode, random_pieces(text, rng)))
            assert "".join(pieces) == call.arguments, text
            # every piece keeps what was sent a prefix of the whole: never taken back
            assert all(call.arguments.startswith("".join(pieces[: k + 1])) for k in range(len(pieces)))


LONG = "the quick brown fox jumps over the lazy dog"


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_a_string_argument_streams_while_it_is_written_and_a_number_only_once_it_ends(parser):
    """Cut in the middle of a string value, the string so far has gone out; cut in the middle of
    an integer (or, where the format shows a value's type only at its end, any value with no
    string schema), none of it has."""
    rng = random.Random(0)
    text = write_call(parser, {"count": 1234567, "text": LONG}, rng)
    mode = ToolMode("auto", SCHEMAS, parser=parser)
    mid_string = text.index("jumps")
    (sent,) = streamed_arguments(stream_chat(mode, [text[:mid_string], ""])[:1])
    assert LONG[: LONG.index("jumps")].rstrip() in "".join(sent), (parser, sent)
    mid_number = text.index("1234") + 2
    sent_by_then = streamed_arguments(stream_chat(mode, [text[:mid_number], ""])[:1])
    assert not any("12" in "".join(p) for p in sent_by_then), (parser, sent_by_then)


def test_xml_values_without_a_string_schema_go_whole():
    """qwen3_coder: a value whose schema is not "string" (or that has none) is typed at its end
    (JSON where it parses), so nothing of it streams before."""
    text = "<tool_call>\n<function=lookup>\n<parameter=extra>\n[1, 2, 3]\n</parameter>\n</function>\n</tool_call>"
    mode = ToolMode("auto", SCHEMAS, parser="qwen3_coder")
    cut = text.index("2, 3")
    (sent,) = streamed_arguments(stream_chat(mode, [text[:cut], ""])[:1])
    assert "".join(sent) == "{"
    (whole,) = streamed_arguments(stream_chat(mode, [text[:cut], text[cut:]]))
    assert "".join(whole) == '{"extra": [1, 2, 3]}'


def test_python_escapes_stream_once_they_are_complete():
    mode = ToolMode("auto", SCHEMAS, parser="pythonic")
    text = r'[lookup(text="a\x41\u00e9\N{BULLET}\101\n\\b")]'
    want = json.dumps({"text": "aAé•A\n\\b"}, ensure_ascii=False)
    for end in range(len(text)):
        deltas = stream_chat(mode, [text[:end], text[end:]])
        first = "".join(streamed_arguments(deltas[:1])[0]) if streamed_arguments(deltas[:1]) else ""
        assert want.startswith(first), (end, first)
        assert "".join(streamed_arguments(deltas)[0]) == want


def test_canonical_json_fed_in_pieces_is_the_canonical_prefix_of_what_came():
    """CanonicalJSON (made as the text comes, each character once) says what canonical_prefix
    says of all the text so far, after every piece; whole, it is json.dumps's form."""
    rng = random.Random(5)
    spaced = r'{ "q" :"caf\u00e9 \ud83d\ude00 \"x\"\n\/" ,"n":1.50, "e": 1E2, "ok":true,"l":[ null ,{}] }'
    for k in range(150):
        whole = spaced if k == 0 else json.dumps(random_arguments(rng), ensure_ascii=k % 2 == 0, indent=k % 3 or None)
        raw = whole if k % 4 else whole[: rng.randint(1, len(whole))]  # (every fourth cut short)
        canonical, out, fed = CanonicalJSON(), "", 0
        for piece in random_pieces(raw, rng):
            out += canonical.feed(piece)
            fed += len(piece)
            assert out == canonical_prefix(raw[:fed])
        if raw == whole:
            assert out == json.dumps(json.loads(whole), ensure_ascii=False)


def test_streamed_calls_start_over_where_a_calls_raw_text_is_rewritten():
    """StreamedCalls makes each call's raw arguments canonical as they grow; raw text that does
    not go on from the last (a format that rewrites its JSON) is read afresh, and only what
    extends what was sent goes out."""
    calls = StreamedCalls()
    first = calls.update([CallInProgress("f", '{"a": "xy')])
    assert first[0]["function"] == {"name": "f", "arguments": '{"a": "xy'}
    assert calls.update([CallInProgress("f", '{ "a":"xyz')]) == [{"index": 0, "function": {"arguments": "z"}}]
    assert calls.update([CallInProgress("f", '{"b": 1')]) == []  # (not an extension of what was sent)
    assert calls.update([CallInProgress("f", '{"a": "xyz", "b": 2}')]) == [
        {"index": 0, "function": {"arguments": '", "b": 2}'}}
    ]


# ---- the Responses and Messages streams (answer_blocks.py) ----
def sse(events: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in events]


class Output:
    def __init__(self, text: str, finish: str | None) -> None:
        self.text, self.finish_reason, self.stop_reason = text, finish, None


def feed_blocks(blocks: AnswerBlocks, mode: ToolMode, pieces: list[str]) -> list[dict]:
    job = Job("id", "chat", [], 1, [None], None)
    job.tool_mode = mode
    ch, out = Choice(), []
    for i, piece in enumerate(pieces):
        out += blocks.feed(job, ch, Output(piece, "stop" if i == len(pieces) - 1 else None))
    return sse(out + blocks.close())


NAMED = ToolMode("named", {"lookup": SCHEMAS["lookup"]}, name="lookup")


def _named_texts(rng: random.Random) -> list[str]:
    """A named call's constrained output: compact JSON (raw control characters allowed in its
    strings, as a grammar may let through), and one cut short by max_tokens."""
    args = random_arguments(rng)
    whole = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    whole = re.sub(r"\\\\|\\n", lambda m: "\n" if m.group() == "\\n" else m.group(), whole)  # \n written raw
    return [whole, whole[: rng.randint(1, len(whole) - 1)]]


@pytest.mark.parametrize("seed", range(20))
def test_responses_stream_a_named_calls_arguments_in_pieces_that_add_up(seed):
    rng = random.Random(seed)
    whole, cut = _named_texts(rng)
    for text in (whole, cut):
        events = feed_blocks(ResponseEvents(None, None), NAMED, random_pieces(text, rng))
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.output_item.added" and events[0]["item"]["type"] == "function_call"
        assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
        assert set(kinds[1:-2]) <= {"response.function_call_arguments.delta"}
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        done = events[-2]["arguments"]
        assert deltas == done == events[-1]["item"]["arguments"]
        if text is whole:  # the non-streamed answer's arguments (ResponseFormat: json_text)
            assert done == json_text(text) and json.loads(done) == json.loads(text, strict=False)


@pytest.mark.parametrize("seed", range(20))
def test_messages_stream_a_named_calls_arguments_as_input_json_deltas(seed):
    rng = random.Random(seed)
    text = _named_texts(rng)[0]
    events = feed_blocks(MessageEvents("m", None), NAMED, random_pieces(text, rng))
    assert events[0]["type"] == "content_block_start" and events[0]["content_block"]["type"] == "tool_use"
    assert events[-1] == {"type": "content_block_stop", "index": 0}
    pieces = [e["delta"]["partial_json"] for e in events[1:-1]]
    assert all(e["delta"]["type"] == "input_json_delta" for e in events[1:-1])
    assert "".join(pieces) == json_text(text)


def test_blocks_stream_auto_calls_as_the_chat_route_does():
    """hermes through the Messages stream: text block, then one tool_use block per call, each
    call's input_json_delta pieces adding up to the whole parse's arguments."""
    rng = random.Random(7)
    text = write_call("hermes", random_arguments(rng), rng) + write_call("hermes", {"text": LONG}, rng)[5:]
    _, calls = REGISTRY["hermes"].parse(text, SCHEMAS)
    mode = ToolMode("auto", SCHEMAS, parser="hermes")
    events = feed_blocks(MessageEvents("m", None), mode, random_pieces(text, rng))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use", "tool_use"]
    for index, call in enumerate(calls, start=1):
        pieces = [e["delta"]["partial_json"] for e in events if e.get("index") == index and "delta" in e]
        assert len(pieces) > 1 and "".join(pieces) == call.arguments
