"""The auto tool-call parsers on their formats' documented shapes: several calls, nested JSON
arguments, strings holding the markers' characters, text before the call, and malformed output,
which stays content. Streamed, each output is fed in small random pieces through the chat
route's delta code: the content deltas add up to the whole parse's content (so nothing of a
call ever leaks into content) and the calls are the whole parse's."""

from __future__ import annotations

import json
import random

import pytest

from engine.entrypoints.openai.chat import chat_stream_delta
from engine.entrypoints.openai.jobs import Choice, Job
from engine.entrypoints.openai.tool_calls import ToolMode
from engine.entrypoints.openai.tool_parsers import REGISTRY, TOOL_CALL_PARSERS

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    },
    "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
}
W = ("get_weather", {"city": "Paris", "days": 3})
S = ("search", {"query": 'a "quoted" [TOOL_CALLS] <tool_call> ]) string', "filters": {"tags": ["x", {"y": None}]}})
S_JSON = json.dumps(S[1])

# parser -> [(text, content, [(name, arguments)])]
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict]]]]] = {
    "hermes": [
        (
            f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(W[1])}}}\n</tool_call>\n'
            f'<tool_call>\n{{"name": "search", "arguments": {S_JSON}}}\n</tool_call>',
            "Checking.",
            [W, S],
        ),
    ],
    "llama3_json": [
        (
            f'{{"name": "get_weather", "parameters": {json.dumps(W[1])}}}; '
            f'{{"name": "search", "parameters": {S_JSON}}}',
            None,
            [W, S],
        ),
    ],
    "llama4_json": [(f'<|python_tag|>{{"name": "search", "parameters": {S_JSON}}}', None, [S])],
    "mistral": [
        (
            f'Let me look. [TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(W[1])}}}, '
            f'{{"name": "search", "arguments": {S_JSON}}}]',
            "Let me look.",
            [W, S],
        ),
        (f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(W[1])}[TOOL_CALLS]search[ARGS]{S_JSON}", None, [W, S]),
        (f"Sure.[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{S_JSON}", "Sure.", [S]),
    ],
    "pythonic": [
        (
            '[get_weather(city="Paris", days=3), search(query=\'a "quoted" [TOOL_CALLS] <tool_call> ]) string\', '
            'filters={"tags": ["x", {"y": None}]})]',
            None,
            [W, S],
        ),
        (
            "<|python_tag|>[search(query='a \"quoted\" [TOOL_CALLS] <tool_call> ]) string', "
            'filters={"tags": ("x", {"y": null})})]',
            None,
            [S],
        ),
    ],
    "llama4_pythonic": [
        ('I will check.<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', "I will check.", [W]),
        ('[get_weather(city="Paris", days=+3)]', None, [W]),
    ],
    "qwen3_coder": [
        (
            "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
            "<parameter=query>\n"
            + S[1]["query"]
            + "\n</parameter>\n<parameter=filters>\n"
            + json.dumps(S[1]["filters"])
            + "\n</parameter>\n</function>\n</tool_call>",
            "Let me see.",
            [W, S],
        ),
    ],
    "granite": [
        (
            f'<|tool_call|>[{{"name": "get_weather", "arguments": {json.dumps(W[1])}}}, '
            f'{{"name": "search", "arguments": {S_JSON}}}]',
            None,
            [W, S],
        ),
        (f'On it. <tool_call>[{{"name": "search", "arguments": {S_JSON}}}]', "On it.", [S]),
    ],
    "internlm": [
        (
            f'I need the weather.<|action_start|><|plugin|>\n{{"name": "get_weather", "parameters": '
            f"{json.dumps(W[1])}}}<|action_end|>",
            "I need the weather.",
            [W],
        ),
        (f'<|action_start|><|plugin|>{{"name": "search", "parameters": {S_JSON}}}<|action_end|>', None, [S]),
    ],
    "deepseek_v3": [
        (
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            + json.dumps(W[1])
            + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
            + json.dumps(S[1])
            + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Checking.",
            [W, S],
        ),
    ],
    "deepseek_v31": [
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            + json.dumps(W[1])
            + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
            + S_JSON
            + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            None,
            [W, S],
        ),
    ],
    "openai": [
        (
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>" + json.dumps(W[1]) + "<|call|>",
            None,
            [W],
        ),
        (
            "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to=functions.search"
            "<|channel|>commentary json<|message|>" + S_JSON + "<|call|>",
            "Looking it up.",
            [S],
        ),
        (
            "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>It is 3.",
            "It is 3.",
            [],
        ),
    ],
}
CASES["glm45"] = [
    (
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search\n"
        "<arg_key>query</arg_key>\n<arg_value>" + S[1]["query"] + "</arg_value>\n<arg_key>filters</arg_key>\n"
        "<arg_value>" + json.dumps(S[1]["filters"]) + "</arg_value>\n</tool_call>",
        "Checking.",
        [W, S],
    ),
]
CASES["kimi_k2"] = [
    (
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        + json.dumps(W[1])
        + "<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
        + S_JSON
        + "<|tool_call_end|><|tool_calls_section_end|>",
        "Checking.",
        [W, S],
    ),
]
CASES["qwen3_xml"] = CASES["qwen3_coder"]

# Output that is not a well-formed call: all of it is content.
MALFORMED: dict[str, list[str]] = {
    "hermes": ["<tool_call>{not json}</tool_call>", "a <tool_call>[1, 2]</tool_call>"],
    "llama3_json": ['{"name": "f"} and words', '{"name": 3, "parameters": {}}'],
    "llama4_json": ['{"parameters": {}}'],
    "mistral": ["[TOOL_CALLS]", '[TOOL_CALLS]f[ARGS]{"a": ', "[TOOL_CALLS]f g[ARGS]{}", '[TOOL_CALLS][{"name": 1}]'],
    "pythonic": [
        "[__import__('os').system('true')]",
        "[f(1)]",
        "[f(a=x)]",
        "[f(a=1+2)]",
        "[f(**{'a': 1})]",
        "[f(a=1)",
        "[1, 2]",
        "[" * 2000,
    ],
    "llama4_pythonic": ["<|python_start|>[f(a=open('x'))]<|python_end|>", "[f(a=[i for i in x])]"],
    "qwen3_coder": [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>",
        "<tool_call><function=f><junk></function></tool_call>",
        "<tool_call>no function</tool_call>",
    ],
    "granite": ["<|tool_call|>[{]", '<|tool_call|>[{"arguments": {}}]'],
    "internlm": ['<|action_start|><|plugin|>{"name": "f", "parameters": {}} extra<|action_end|>'],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>no separator<｜tool▁call▁end｜>",
    ],
    "glm45": [
        "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>",
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{x<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>",
    ],
    "openai": [
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad<|call|>",
        "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
        "<|channel|>final",
    ],
}
MALFORMED["qwen3_xml"] = MALFORMED["qwen3_coder"]
MALFORMED["deepseek_v31"] = MALFORMED["deepseek_v3"]
PLAIN = ["Just an answer, no calls.", "a < b and [x] {y}", "  spaced  \n", ""]


def test_every_parser_has_cases():
    assert set(CASES) == set(MALFORMED) == set(TOOL_CALL_PARSERS) == set(REGISTRY)


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", [(p, *case) for p, cases in CASES.items() for case in cases])
def test_documented_examples(parser, text, content, calls):
    got_content, got_calls = REGISTRY[parser].parse(text, SCHEMAS)
    assert got_content == content and _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser,text", [(p, t) for p, texts in MALFORMED.items() for t in texts + PLAIN])
def test_anything_else_is_content(parser, text):
    assert REGISTRY[parser].parse(text, SCHEMAS) == (text, [])


def test_mistral_ids_are_nine_alphanumerics_and_keep_the_models_own():
    _, calls = REGISTRY["mistral"].parse(CASES["mistral"][0][0], SCHEMAS)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, calls = REGISTRY["mistral"].parse(CASES["mistral"][2][0], SCHEMAS)
    assert calls[0].id == "a1b2c3d4e"


def test_kimi_k2_keeps_the_models_call_ids():
    _, calls = REGISTRY["kimi_k2"].parse(CASES["kimi_k2"][0][0], SCHEMAS)
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.search:1"]


def test_qwen3_values_are_typed_from_the_schema_else_json_else_text():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nthree\n"
        "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n"
        "<parameter=note>\nnot json\n</parameter>\n</function>\n</tool_call>"
    )
    _, calls = REGISTRY["qwen3_coder"].parse(text, SCHEMAS)
    # city is a string by its schema; "three" is no integer, so it stays text; extra/note have no schema
    assert json.loads(calls[0].arguments) == {
        "city": "42",
        "days": "three",
        "metric": True,
        "extra": [1, 2],
        "note": "not json",
    }


def _stream(parser: str, text: str, rng: random.Random) -> tuple[str, list[dict]]:
    """The output fed in random pieces; (content, calls) as a client puts the deltas together:
    per call index its id and name (from the call's first delta) and its argument pieces."""
    job = Job("id", "chat", [], 1, [None], None)
    job.tool_mode = ToolMode("auto", SCHEMAS, parser=parser)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3))) if len(text) > 1 else []
    points = [0, *cuts, len(text)]
    ch, content, calls = Choice(), "", []
    for i, (a, b) in enumerate(zip(points, points[1:])):
        last = i == len(points) - 2
        delta, _ = chat_stream_delta(job, ch, text[a:b], "stop" if last else None)
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if tc["index"] == len(calls):  # a new call: its first delta says what it is
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"]
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "pieces": []})
            else:
                assert "id" not in tc and "name" not in tc["function"]
            calls[tc["index"]]["pieces"].append(tc["function"].get("arguments", ""))
    return content, calls


STREAMS_ARGUMENTS = sorted(p for p, parser in REGISTRY.items() if parser.progress is not None)


def test_the_json_formats_stream_arguments_as_they_are_written():
    assert {"hermes", "llama3_json", "llama4_json", "granite", "internlm", "mistral"} <= set(STREAMS_ARGUMENTS)


@pytest.mark.parametrize("parser,text", [(p, case[0]) for p, cases in CASES.items() for case in cases])
def test_streamed_in_random_pieces_adds_up_to_the_whole_parse(parser, text):
    want_content, want_calls = REGISTRY[parser].parse(text, SCHEMAS)
    for seed in range(8):
        content, calls = _stream(parser, text, random.Random(seed))
        assert content == (want_content or "")
        assert [c["name"] for c in calls] == [c.name for c in want_calls]
        for got, want in zip(calls, want_calls):
            if parser in STREAMS_ARGUMENTS:  # the pieces add up to the whole parse's arguments, exactly
                assert "".join(got["pieces"]) == want.arguments
                assert len([p for p in got["pieces"] if p]) > 1 or len(want.arguments) < 8, got
            else:
                assert json.loads("".join(got["pieces"])) == json.loads(want.arguments)


@pytest.mark.parametrize(
    "parser,text", [(p, t) for p, texts in MALFORMED.items() for t in texts + PLAIN[:3] if len(t) < 500]
)
def test_malformed_output_streamed_is_content_or_a_cut_call(parser, text):
    """What is no call in the whole parse streams as content; where the stream had already sent
    a call (its name complete), the call stays as sent and its text is not content (as a call
    cut short by max_tokens)."""
    want_content, want_calls = REGISTRY[parser].parse(text, SCHEMAS)
    assert not want_calls
    for seed in range(8):
        content, calls = _stream(parser, text, random.Random(seed))
        if calls:
            assert parser in STREAMS_ARGUMENTS and content == text[: REGISTRY[parser].streamable(text)]
        else:
            assert content == (want_content or "")


def test_arguments_stream_in_json_dumps_form_whatever_the_models_spacing_and_escapes():
    raw = r'{ "q" :"caf\u00e9 \ud83d\ude00 \"x\"\n\/" ,"n":1.50, "e": 1E2, "ok":true,"l":[ null ,{}] }'
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    text = f'<tool_call>{{"name": "search", "arguments": {raw}}}</tool_call>'
    for seed in range(20):
        _, (call,) = _stream("hermes", text, random.Random(seed))
        assert "".join(call["pieces"]) == want
        assert all(want.startswith("".join(call["pieces"][: k + 1])) for k in range(len(call["pieces"])))


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_no_prefix_of_a_call_is_streamed_as_content(parser):
    """Each prefix of a call (text before it aside) is held back whole."""
    for text, content, calls in CASES[parser]:
        if not calls:
            continue
        streamable = REGISTRY[parser].streamable
        for end in range(len(text) + 1):
            assert streamable(text[:end]) <= len(content or "")


def test_the_settings_offer_exactly_the_registered_parsers():
    from typing import get_args

    from engine.config.server_settings import ServerSettings
    from engine.entrypoints.openai.reasoning import REASONING_PARSERS

    def choices(field: str) -> set[str]:
        literal = next(a for a in get_args(ServerSettings.model_fields[field].annotation) if a is not type(None))
        return set(get_args(literal))

    assert choices("tool_call_parser") == set(TOOL_CALL_PARSERS)
    assert choices("reasoning_parser") == set(REASONING_PARSERS)


@pytest.mark.parametrize(
    "parser,reasoning,keep",
    [
        ("hermes", None, False),
        ("mistral", None, True),
        ("openai", None, True),
        ("deepseek_v3", None, True),
        ("hermes", "gpt_oss", True),
        ("hermes", "qwen3", False),
        (None, "mistral", True),
    ],
)
def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text(parser, reasoning, keep):
    from engine.entrypoints.openai.chat import keeps_special_tokens

    mode = ToolMode("auto", {}, parser=parser) if parser else ToolMode("none", {})
    assert keeps_special_tokens(mode, reasoning) is keep
    if parser:  # a named or required call is constrained JSON: the auto parser plays no part
        assert keeps_special_tokens(ToolMode("required", {}, parser=None), None) is False
