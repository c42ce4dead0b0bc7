"""Reasoning parsers and chat-template options: split answers into reasoning_content and content
(whole and streamed: the streamed pieces add up to the whole split, wherever the text is cut),
chat_template_kwargs and continue_final_message reach the template, suffix / best_of refused."""

from __future__ import annotations

import asyncio

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.entrypoints.openai.chat import chat_stream_delta as _chat_stream_delta
from engine.entrypoints.openai.jobs import Choice as _Choice
from engine.entrypoints.openai.jobs import Job as _Job
from engine.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser
from engine.entrypoints.openai.tool_calls import ToolMode


@pytest.mark.parametrize(
    "kind,text,want",
    [
        ("deepseek_r1", "plan it</think>\n\nThe answer.", ("plan it", "The answer.")),
        ("deepseek_r1", "<think>plan</think>done", ("plan", "done")),
        ("deepseek_r1", "still thinking", ("still thinking", None)),
        ("qwen3", "<think>\nhmm\n</think>\n\nYes.", ("\nhmm\n", "Yes.")),
        ("qwen3", "No block at all.", (None, "No block at all.")),
        ("qwen3", "<think>unterminated", ("unterminated", None)),
        ("deepseek_v3", "plan</think>Done.", ("plan", "Done.")),
        ("step3", "<think>plan</think>\nDone.", ("plan", "Done.")),
        ("glm45", "<think>plan</think>Done.", ("plan", "Done.")),
        ("glm45", "Done.", (None, "Done.")),
        ("hunyuan", "<think>\nplan\n</think>\n<answer>\nDone.\n</answer>", ("\nplan\n", "Done.")),
        ("hunyuan", "<answer>Done.", (None, "Done.")),
        ("hunyuan", "Plain.", (None, "Plain.")),
        ("mistral", "[THINK]a [b] c[/THINK]Done.", ("a [b] c", "Done.")),
        ("mistral", "Done. [THINK]", (None, "Done. [THINK]")),
        ("granite", "Here is my thought process:\nplan\nHere is my response:\nDone.", ("\nplan\n", "Done.")),
        ("granite", "Here is the answer.", (None, "Here is the answer.")),
        (
            "gpt_oss",
            "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
            ("plan", "Done."),
        ),
        (
            "gpt_oss",
            "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary to=functions.f "
            "<|constrain|>json<|message|>{}<|call|>",
            ("plan", "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"),
        ),
        ("gpt_oss", "no harmony at all", (None, "no harmony at all")),
        (
            "gpt_oss",
            "<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant to=functions.f<|channel|>commentary"
            "<|message|>{}<|call|>",
            (None, "Checking. <|start|>assistant to=functions.f<|channel|>commentary<|message|>{}<|call|>"),
        ),
    ],
)
def test_split_whole_answers(kind, text, want):
    assert ReasoningParser(kind).split(text) == want


def _stream(job: _Job, pieces: list[str]) -> tuple[str, str, list, str | None]:
    ch = _Choice()
    reasoning, content, calls, finish = "", "", [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, finish = _chat_stream_delta(job, ch, piece, "stop" if last else None)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return reasoning, content, calls, finish


def _job(reasoning: str | None, tools: ToolMode | None = None) -> _Job:
    job = _Job("id", "chat", [], 1, [None], None)
    job.reasoning = ReasoningParser(reasoning) if reasoning else None
    job.tool_mode = tools
    return job


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(REASONING_PARSERS),
    text=st.sampled_from(
        [
            "<think>a<b</think>\nc</think>d",
            "x</thin",
            "<think>\n</think>",
            "<thi",
            "plain <think>",
            "r1 plan</think>answer <tool_call>",
            "<think>q</think><think>",
            "<think>p</think>\n<answer>\nA <b>\n</answer>",
            "[THINK]a[/THINK]b [/THINK]",
            "Here is my thought process: p Here is my response: r",
            "<|channel|>analysis<|message|>p <|e<|end|><|start|>assistant<|channel|>final<|message|>A<|return|>",
            "<|channel|>analysis<|message|>p<|end|><|start|>assistant to=functions.f<|channel|>commentary<|message|>{}",
        ]
    ),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_streamed_pieces_add_up_to_the_whole_split(kind, text, cuts):
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [""]
    reasoning, content, _, _ = _stream(_job(kind), pieces)
    want_r, want_c = ReasoningParser(kind).split(text)
    assert (reasoning, content) == (want_r or "", want_c or "")


def test_gpt_oss_reasoning_then_an_openai_tool_call_streamed():
    job = _job("gpt_oss", ToolMode("auto", {"f": {}}, parser="openai"))
    text = (
        "<|channel|>analysis<|message|>Call f.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
        '<|constrain|>json<|message|>{"x": 1}<|call|>'
    )
    reasoning, content, calls, finish = _stream(job, [text[i : i + 5] for i in range(0, len(text), 5)])
    assert reasoning == "Call f." and content == "" and finish == "tool_calls"
    text = text.replace("<|end|>", "<|end|><|start|>assistant<|channel|>commentary<|message|>Calling f.<|end|>", 1)
    reasoning, content, calls, finish = _stream(job, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert reasoning == "Call f." and content == "Calling f." and finish == "tool_calls"
    # (the call's first delta names it; its arguments come in pieces as they are written)
    assert {c["index"] for c in calls} == {0} and calls[0]["function"]["name"] == "f" and len(calls) > 1
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"x": 1}'


def test_reasoning_then_a_tool_call_streamed():
    job = _job("deepseek_r1", ToolMode("auto", {"f": {}}, parser="hermes"))
    text = 'I should call f.</think>\nOK <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    reasoning, content, calls, finish = _stream(job, [text[i : i + 7] for i in range(0, len(text), 7)])
    assert reasoning == "I should call f." and content.strip() == "OK" and finish == "tool_calls"
    assert calls[0]["function"]["name"] == "f"


TEMPLATE = (
    "{% if enable_thinking %}THINKING ON{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def client(tiny_llama):
    from tests.support.engine import served

    with served(tiny_llama, {"reasoning_parser": "deepseek_r1"}, chat_template=TEMPLATE) as (_, _, client):
        yield client


def test_server_reasoning_content_and_template_options(client):
    async def main():
        ask = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0.9, seed=4)
        whole = await client.chat.completions.create(**ask)
        message = whole.choices[0].message
        # The random model never writes </think>: with deepseek_r1 all of it is reasoning.
        assert message.content is None and message.reasoning_content
        streamed = ""
        async for chunk in await client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta
            assert not delta.content
            streamed += getattr(delta, "reasoning_content", None) or ""
        assert streamed == message.reasoning_content
        # a constraint waits for the end of the thinking, which this model never writes
        # (test_structured_output.py forces one and sees the constraint start there)
        constrained = await client.chat.completions.create(**{**ask, "extra_body": {"guided_choice": ["yes", "no"]}})
        assert constrained.choices[0].message.content is None
        assert constrained.choices[0].message.reasoning_content == message.reasoning_content

        on = await client.chat.completions.create(
            **{**ask, "max_tokens": 1, "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
        )
        off = await client.chat.completions.create(**{**ask, "max_tokens": 1})
        assert on.usage.prompt_tokens > off.usage.prompt_tokens
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
        cont = await client.chat.completions.create(
            model="m",
            messages=conv,
            max_tokens=1,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
        new_turn = await client.chat.completions.create(model="m", messages=conv, max_tokens=1)
        assert cont.usage.prompt_tokens < new_turn.usage.prompt_tokens
        for extra, param in [
            ({"continue_final_message": True}, "continue_final_message"),
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=conv, max_tokens=1, extra_body=extra)
            assert info.value.body["param"] == param
        for extra, param in [({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="m", prompt="hi", max_tokens=1, extra_body=extra)
            assert info.value.body["param"] == param
        ok = await client.completions.create(model="m", prompt="hi", max_tokens=1, n=2, extra_body={"best_of": 2})
        assert len(ok.choices) == 2

    asyncio.run(main())
