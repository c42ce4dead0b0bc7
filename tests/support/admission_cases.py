"""The requests each admission rule refuses (tests/core/test_admission.py runs them offline, through
the server and by beam search), and the Admission on a stub vocabulary, tokenizer and grammar
compiler that the rules on the engine's state run on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from engine.core.params import LoRARequest, PoolingParams, SamplingParams, StructuredOutputsParams
from engine.runtime.admission import Admission
from engine.runtime.beam_search import BeamSearchParams

ENGINE = Path(__file__).resolve().parents[2] / "engine"
TABLE = ENGINE / "core" / "admission_rules"  # (a package: every module of it is the table)

CHAT = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields) -> tuple[str, dict]:
    return CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


def completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "hi", "max_tokens": 2} | fields


@dataclass
class Case:
    rule: str
    match: str  # (a regex)
    param: str | None
    offline: Callable[[Any, Any], Any] | None = None  # (llm, ctx)
    http: Callable[[Any], tuple[str, dict]] | None = None  # (ctx) -> (path, body)
    beam: Callable[[Any, Any], Any] | None = None  # (llm, ctx)
    unit: Callable[[Admission], Any] | None = None  # on the stub Admission

    def __str__(self) -> str:
        return self.rule


def gen(prompt, **params):
    return lambda llm, ctx: llm.generate([prompt], SamplingParams(**params), use_tqdm=False)


def beam(prompt, width=2, max_tokens=2):
    return lambda llm, ctx: llm.beam_search([prompt], BeamSearchParams(width, max_tokens))


def same_id_twice(llm) -> None:
    llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), "dup")
    try:
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), "dup")
    finally:
        llm.engine.abort_request("dup")


SLOTS_FULL = "all max_loras=1 LoRA slots hold adapters (x); unload one first"  # (LoRAManager.why_not's)
LONG = list(range(1, 65))  # max_model_len tokens: no room left
CASES = [
    # SamplingParams (as made: offline, by the server from a body, by beam search from its params)
    Case(
        "sampling",
        "n must be at least 1, got 0",
        "n",
        gen("hi", n=0),
        lambda c: completion(n=0),
        lambda llm, ctx: BeamSearchParams(0, 3),
    ),
    Case(
        "sampling",
        "max_tokens must be at least 1, got 0",
        "max_tokens",
        gen("hi", max_tokens=0),
        lambda c: chat(max_tokens=0),
        lambda llm, ctx: BeamSearchParams(2, 0),
    ),
    Case(
        "sampling",
        "at most 1024 stop strings, got 1025",
        "stop",
        gen("hi", stop=[f"s{i}" for i in range(1025)]),
        None,  # (the server refuses it before validating the strings: stop_string_count)
    ),
    Case(
        "sampling",
        "the stop strings hold 70000 characters, more than 65536",
        "stop",
        gen("hi", stop=["x" * 35000, "y" * 35000]),
        None,
    ),
    Case(
        "stop_string_count",
        "at most 1024 stop strings, got 1025",
        "stop",
        None,
        lambda c: completion(stop=[f"s{i}" for i in range(1025)]),
    ),
    Case(
        "stop_string_count",
        "the stop strings hold 70000 characters, more than 65536",
        "stop",
        None,
        lambda c: chat(stop=["x" * 35000, "y" * 35000]),
    ),
    Case(
        "logit_bias_map",
        "logit_bias must map token ids to numbers",
        "logit_bias",
        gen("hi", logit_bias={"x": 1}),
        lambda c: completion(logit_bias={"x": 1}),
    ),
    Case(
        "constraint_from_fields",
        "structured_outputs: .*bogus",
        "structured_outputs",
        gen("hi", structured_outputs={"bogus": 1}),
        lambda c: completion(structured_outputs={"bogus": 1}),
    ),
    Case(
        "stop_tokens_leave_a_choice",
        "every allowed token is a stop token",
        "allowed_token_ids",
        lambda llm, c: gen("hi", allowed_token_ids=[c.eos], min_tokens=1)(llm, c),
        lambda c: completion(allowed_token_ids=[c.eos], min_tokens=1),
    ),
    # constraints
    Case(
        "schema_from_text",
        "the JSON schema is not valid JSON",
        "structured_outputs",
        lambda llm, c: StructuredOutputsParams(json="{bad"),
        lambda c: completion(structured_outputs={"json": "{bad"}),
    ),
    Case(
        "constraint_kind",
        r"give exactly one of .* \(got none\)",
        "structured_outputs",
        lambda llm, c: StructuredOutputsParams(),
        lambda c: completion(structured_outputs={}),
    ),
    Case(
        "constraint",
        "choice must be a non-empty list",
        "structured_outputs",
        lambda llm, c: StructuredOutputsParams(choice=[]),
        lambda c: completion(structured_outputs={"choice": []}),
    ),
    Case(
        "constraint_does_not_compile",
        "the regex constraint does not compile",
        "structured_outputs",
        gen("hi", structured_outputs=StructuredOutputsParams(regex="(")),
        lambda c: completion(structured_outputs={"regex": "("}),
    ),
    Case(
        "constraint_in_field",
        "^guided_regex: structured output: the regex constraint does not compile",
        "guided_regex",
        http=lambda c: completion(guided_regex="("),
    ),
    # embeddings and the task
    Case(
        "pooling",
        "pooling_type must be one of last, mean",
        "pooling_type",
        lambda llm, c: llm.embed("hi", PoolingParams("max"), use_tqdm=False),
    ),
    Case(
        "dimensions_fit",
        "exceeds the model's hidden size",
        "dimensions",
        lambda llm, c: llm.embed("hi", PoolingParams(dimensions=10**6), use_tqdm=False),
        lambda c: ("/v1/embeddings", {"input": "hi", "dimensions": 10**6}),
    ),
    Case(
        "model_generates",
        "no language-model head",
        "model",
        unit=lambda a: with_state(
            a, model_config=SimpleNamespace(vocab_size=100, generates=False, hidden_size=16)
        ).admit([1], SamplingParams()),
    ),
    # the engine's limits
    Case(
        "logprobs_limit",
        "logprobs must be at most 5",
        "logprobs",
        gen("hi", logprobs=6),
        lambda c: completion(logprobs=6),
    ),
    Case(
        "logprobs_limit", "logprobs must be at most 5", "logprobs", None, lambda c: chat(logprobs=True, top_logprobs=6)
    ),
    Case(
        "logprobs_limit",
        "prompt_logprobs must be at most 5",
        "prompt_logprobs",
        gen("hi", prompt_logprobs=6),
        lambda c: completion(prompt_logprobs=6),
    ),
    Case(
        "samples_limit",
        "exceeds this server's max_num_seqs",
        "n",
        gen("hi", n=5, temperature=1.0),
        lambda c: completion(n=5),
    ),
    Case(
        "token_ids",
        r"prompt: token ids must be integers in \[0, ",
        "prompt",
        gen([5, 10**6]),
        lambda c: completion(prompt=[5, 10**6]),
        beam([5, 10**6]),
    ),
    Case(
        "token_ids",
        "stop_token_ids: token ids must be",
        "stop_token_ids",
        gen("hi", stop_token_ids=[10**6]),
        lambda c: completion(stop_token_ids=[10**6]),
    ),
    Case(
        "token_id_count",
        "token ids, more than the vocabulary",
        "allowed_token_ids",
        None,
        lambda c: completion(allowed_token_ids=list(range(c.vocab + 1))),
    ),
    Case(
        "prompt_length",
        "prompt: the prompt is empty",
        "prompt",
        gen([]),
        lambda c: completion(prompt=[[]]),
        beam([]),
    ),
    Case(
        "prompt_length",
        "prompt: the prompt has 64 token ids, which leaves no room",
        "prompt",
        gen(LONG),
        lambda c: completion(prompt=LONG),
        beam(LONG),
    ),
    Case(
        "prompt_length",
        r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds max_model_len=64",
        "max_tokens",
        gen(LONG[:60], max_tokens=10),
        lambda c: completion(prompt=LONG[:60], max_tokens=10),
        beam(LONG[:60], max_tokens=10),
    ),
    Case("text_length", "far longer than max_model_len", "prompt", None, lambda c: completion(prompt="x" * 10**5)),
    Case(
        "message_count",
        "65 messages cannot fit",
        "messages",
        None,
        lambda c: chat(messages=[{"role": "user", "content": "hi"}] * 65),
    ),
    Case("tool_count", "tools: 1025 tools, more than 1024", "tools", None, lambda c: chat(tools=[TOOL] * 1025)),
    Case(
        "tool_definition_size",
        r"tools\[1\]: the definition holds more than 10000 JSON values",
        "tools[1]",
        None,
        lambda c: chat(tools=[TOOL, {"type": "function", "function": {"name": "g", "enum": [0] * 10_000}}]),
    ),
    Case(
        "content_part_count",
        "65 content parts cannot fit",
        "messages",
        None,
        lambda c: chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 65}]),
    ),
    Case(
        "logit_bias_count",
        "logit_bias: .* entries, more than the vocabulary",
        "logit_bias",
        None,
        lambda c: completion(logit_bias={str(i): 1 for i in range(c.vocab + 1)}),
    ),
    Case(
        "prompt_count",
        "too many prompts or samples in one request",
        "prompt",
        None,
        lambda c: completion(prompt=["hi"] * 65),
    ),
    Case(
        "prompt_count",
        r"too many prompts or samples in one request \(68; at most 64\)",
        "prompt",
        None,
        lambda c: completion(prompt=["hi"] * 17, n=4),
    ),
    Case(
        "kv_capacity",
        "needs up to 4 KV blocks but the cache holds only 2",
        "max_tokens",
        unit=lambda a: with_state(a, kv=SimpleNamespace(block_size=4, usable_blocks=lambda priority: 2)).admit(
            [1] * 8, SamplingParams(max_tokens=6)
        ),
    ),
    Case("request_id_free", "request id 'dup' is already in use", "request_id", lambda llm, c: same_id_twice(llm)),
    Case(
        "lora_adapter",
        "enable_lora",
        "model",
        lambda llm, c: llm.generate("hi", use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere")),
    ),
    Case(
        "lora_adapter",
        r"all max_loras=1 LoRA slots hold adapters \(x\); unload one first",
        "model",
        unit=lambda a: with_state(a, lora=SimpleNamespace(why_not=lambda r: SLOTS_FULL)).admit(
            [1], SamplingParams(max_tokens=1), lora_request=LoRARequest("y", 2, "/y")
        ),
    ),
    # the HTTP API's own fields
    Case("prompt_given", "the prompt must not be empty", "prompt", None, lambda c: completion(prompt=[])),
    Case("prompt_given", "input must not be empty", "input", None, lambda c: ("/v1/embeddings", {"input": []})),
    Case("suffix_unsupported", "suffix is not supported", "suffix", None, lambda c: completion(suffix="end")),
    Case("best_of", "best_of is not supported", "best_of", None, lambda c: completion(best_of=3)),
    Case("zero_max_tokens", r"0 only with echo=true", "max_tokens", None, lambda c: completion(max_tokens=0)),
    Case("top_logprobs", "top_logprobs requires logprobs=true", "top_logprobs", None, lambda c: chat(top_logprobs=3)),
    Case(
        "top_logprobs",
        "top_logprobs must be non-negative",
        "top_logprobs",
        None,
        lambda c: chat(logprobs=True, top_logprobs=-1),
    ),
    Case(
        "json_schema_given",
        "type json_schema needs json_schema.schema",
        "response_format",
        None,
        lambda c: chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    ),
    Case(
        "one_constraint_field",
        "give one structured-output constraint, not several",
        "guided_choice",
        None,
        lambda c: completion(guided_regex="a", guided_choice=["a"]),
    ),
    Case(
        "forced_tool_alone",
        "constrains the output itself",
        "tool_choice",
        None,
        lambda c: chat(tools=[TOOL], tool_choice="required", guided_regex="a"),
    ),
    Case("messages_given", "messages must not be empty", "messages", None, lambda c: chat(messages=[])),
    Case(
        "message_role",
        "unknown role 'wizard'",
        "messages[0].role",
        None,
        lambda c: chat(messages=[{"role": "wizard", "content": "hi"}]),
    ),
    Case(
        "text_part",
        "only text parts are supported",
        "messages[0].content",
        None,
        lambda c: chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    ),
    Case(
        "one_of_prompt_messages", "give exactly one of prompt or messages", "prompt", None, lambda c: ("/tokenize", {})
    ),
    Case(
        "beam_search_alone",
        "use_beam_search cannot stream",
        "stream",
        None,
        lambda c: completion(use_beam_search=True, stream=True),
    ),
    Case(
        "continue_final_message",
        "needs add_generation_prompt=false",
        "continue_final_message",
        None,
        lambda c: chat(continue_final_message=True),
    ),
    Case(
        "template_kwargs",
        "chat_template_kwargs may not set tools",
        "chat_template_kwargs",
        None,
        lambda c: chat(chat_template_kwargs={"tools": 1}),
    ),
    Case(
        "tool_name_unused",
        "the function name 'f' is used twice",
        "tools",
        None,
        lambda c: chat(tools=[TOOL, TOOL], tool_choice="required"),
    ),
    Case(
        "named_tool_given",
        "names the function 'g', which is not in tools",
        "tool_choice",
        None,
        lambda c: chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
    ),
    Case(
        "tool_choice_needs_tools",
        "tool_choice 'required' needs tools",
        "tool_choice",
        None,
        lambda c: chat(tool_choice="required"),
    ),
    Case(
        "auto_tool_parser",
        "needs the server started with --enable-auto-tool-choice",
        "tool_choice",
        None,
        lambda c: chat(tools=[TOOL]),
    ),
]


# ---- the stub Admission ----
class StubGrammars:
    def __init__(self) -> None:
        self.compiled: list[StructuredOutputsParams] = []

    def compile(self, spec: StructuredOutputsParams):
        self.compiled.append(spec)
        return ("compiled", spec.cache_key())


class StubTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def stub_admission(**state) -> Admission:
    config = SimpleNamespace(vocab_size=100, generates=True, hidden_size=16)
    return Admission(
        config,
        "m",
        max_model_len=16,
        max_num_seqs=4,
        max_logprobs=5,
        tokenizer=StubTokenizer(),
        grammars=StubGrammars(),
        **state,
    )


def with_state(a: Admission, **state) -> Admission:
    for name, value in state.items():
        setattr(a, name, value)
    return a
