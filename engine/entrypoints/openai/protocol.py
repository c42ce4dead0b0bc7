"""The OpenAI-compatible request models (pydantic) and their mapping to SamplingParams.

A request body is parsed once, into one of these models (RequestBody); its unknown fields are
kept (extra="allow"), logged as it is parsed, and ignored. Ranges that the engine checks
(temperature >= 0, n >= 1, ...) and the API's own rules (best_of, suffix, one constraint
field...) are engine/core/admission_rules/'s, so there is one rule and one message for each;
the models only pin types, and bounds that keep values sane before they reach the engine.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from engine.config.generation_config import GenerationDefaults, apply_generation_defaults
from engine.core import admission_rules as rules
from engine.core.params import SamplingParams, StructuredOutputsParams
from engine.entrypoints.openai.tool_calls import ToolMode, arguments_for_template, resolve_tool_mode

logger = logging.getLogger("engine.entrypoints.openai")

INT64 = 2**63 - 1


def _prompt_form(value: Any) -> str:
    """Which form a prompt field takes, from its first element: pydantic then validates that
    form alone (trying every form of a long list of token ids costs an error per element)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "list[str]"
        if isinstance(value[0], list):
            return "list[list[int]]"
    return "list[int]"


# A prompt: text, texts, token ids or lists of token ids (tags named as errors.py drops them from paths).
PromptInput = Annotated[
    Union[
        Annotated[str, Tag("str")],
        Annotated[list[str], Tag("list[str]")],
        Annotated[list[int], Tag("list[int]")],
        Annotated[list[list[int]], Tag("list[list[int]]")],
    ],
    Discriminator(_prompt_form),
]


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class RequestBody(Lenient):
    """A whole request body: its unknown top-level fields are logged once, as it is parsed."""

    def model_post_init(self, context: Any) -> None:
        unknown = self.unknown_fields()
        if unknown:
            logger.info("ignoring unknown request fields: %s", ", ".join(unknown))


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk


class JSONSchemaFormat(Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    """OpenAI's response_format: "text", "json_object" (any JSON object) or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(RequestBody):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, le=INT64, ge=-INT64)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, le=INT64, ge=-INT64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM users rely on these).
    top_k: int | None = Field(None, le=INT64, ge=-INT64)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, le=INT64, ge=-INT64)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, le=INT64, ge=-INT64)
    prompt_logprobs: int | None = Field(None, le=INT64, ge=-INT64)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(None, le=INT64, ge=-INT64)  # vLLM: keep the last N prompt tokens
    use_beam_search: bool = False  # vLLM: n beams instead of n samples (engine/runtime/beam_search.py)
    length_penalty: float = 1.0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its
    # older guided_* fields. At most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The request's constraint, made (and so validated) here, once per request."""
        found = self.structured_output_field()
        if found is None:
            return None
        name, fields = found
        return rules.constraint_from_fields(StructuredOutputsParams, fields, name)

    def constraint_field(self) -> str:
        """The field a constraint came in, to name in a compile error (a forced tool call's: tools)."""
        found = self.structured_output_field()
        return found[0] if found is not None else "tools"

    def structured_output_field(self) -> tuple[str, dict[str, Any]] | None:
        """(the request field that holds the constraint, its fields), or None."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            rules.json_schema_given(rf.json_schema.schema_ if rf.json_schema is not None else None)
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None
        rules.one_constraint_field([name for name, _ in given])
        return given[0]

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: GenerationDefaults | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams, made (and so validated) once: with the model's defaults
        (generation_config.json) for the fields the request left out."""
        own = self.structured_output_params()  # (checked even when a forced tool call replaces it)
        fields = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=own if structured_outputs is None else structured_outputs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
        if defaults is not None:
            fields = apply_generation_defaults(fields, defaults, self.model_fields_set)
        return SamplingParams(**fields)

    def check_beam_search(self, with_tools: bool) -> None:
        """use_beam_search returns whole beams: no stream, no constraint, no tools."""
        if self.use_beam_search:
            rules.beam_search_alone(bool(self.stream), self.structured_output_field() is not None or with_tools)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def prompt_list(p: str | list, param: str = "prompt") -> list[str | list[int]]:
    """OpenAI's prompt / input field as a list of prompts (text, or token ids)."""
    if isinstance(p, str):
        return [p]
    rules.prompt_given(len(p), param)
    if isinstance(p[0], int):  # one prompt of token ids (validated: its first item picked the form)
        return [p]
    return list(p)


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, le=INT64, ge=-INT64)
    logprobs: int | None = Field(None, le=INT64, ge=-INT64)
    echo: bool = False
    suffix: str | None = None  # refused: fill-in-the-middle needs a model-specific prompt format
    best_of: int | None = Field(None, le=INT64, ge=-INT64)  # refused unless equal to n (as vLLM V1)

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (OpenAI's legacy completions)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        rules.suffix_unsupported(self.suffix)
        rules.best_of(self.best_of, self.n)
        self.check_beam_search(with_tools=False)
        # echo with logprobs: the echoed prompt tokens carry their logprobs too (what
        # loglikelihood evaluations read).
        prompt_logprobs = None
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        max_tokens = self.max_tokens
        if max_tokens == 0:
            rules.zero_max_tokens(self.echo)
            max_tokens = 1  # the engine computes the prompt and samples one token, which is not returned
        return self._params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessage(Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, le=INT64, ge=-INT64)
    max_completion_tokens: int | None = Field(None, le=INT64, ge=-INT64)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, le=INT64, ge=-INT64)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # continue the last (assistant) message instead of a new turn
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    def tool_mode(self, auto_parser: str | None) -> ToolMode:
        tools = [t.model_dump() for t in self.tools or []]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        mode = resolve_tool_mode(tools, choice, auto_parser)
        if mode.forced:
            rules.forced_tool_alone(mode.kind, self.structured_output_field() is not None)
        return mode

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)

    def sampling_params(
        self, tool_mode: ToolMode | None = None, defaults: GenerationDefaults | None = None
    ) -> SamplingParams:
        """With a forced tool choice, the output is constrained to the call's JSON."""
        rules.top_logprobs(self.top_logprobs, self.logprobs)
        self.check_beam_search(with_tools=bool(self.tools))
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        constraint = None
        if tool_mode is not None and tool_mode.forced:
            constraint = tool_mode.constraint(self.parallel_tool_calls is not False)
        return self._params(max_tokens, logprobs, defaults=defaults, structured_outputs=constraint)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: text parts joined, tool calls' arguments as dicts."""
    rules.messages_given(len(messages))
    out = []
    for i, m in enumerate(messages):
        rules.message_role(i, m.role)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                rules.text_part(i, part.type, part.text)
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = arguments_for_template(m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class EmbeddingRequest(RequestBody):
    """OpenAI's /v1/embeddings (plus vLLM's priority and normalize)."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, le=INT64, ge=-INT64)
    user: str | None = None
    priority: int = Field(0, le=INT64, ge=-INT64)
    normalize: bool = True

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


class LoadLoRAAdapterRequest(Lenient):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(Lenient):
    lora_name: str = Field(min_length=1)


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "server_error", "service_unavailable", "timeout"
]
