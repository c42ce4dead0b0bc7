"""GenerationRequest: what a completion or chat route hands the generation step, in one value.

A route parses its body once (protocol.py), checks it (admission.py) and builds one of these;
generation.py runs it (beams or a job) and jobs.py streams or collects it. Nothing after the
route looks at the HTTP body again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.params import LoRARequest, SamplingParams
from engine.core.request_kinds import Task
from engine.entrypoints.openai.reasoning import ReasoningParser
from engine.entrypoints.openai.tool_calls import ToolMode

# Each API's ids: OpenAI's completions and chat, Anthropic's messages, OpenAI's responses.
ID_PREFIXES = {"completion": "cmpl", "chat": "chatcmpl", "message": "msg", "response": "resp"}


@dataclass
class GenerationRequest:
    kind: str  # "completion" | "chat" | "message" | "response": names the ids (ID_PREFIXES)
    prompts: list[list[int]]  # each prompt's ids, fitted to max_model_len
    texts: list[str | None]  # each prompt's text where the client sent text (echo)
    params: SamplingParams
    task: Task
    grammar: Any = None  # the compiled constraint (None without one)
    lora: LoRARequest | None = None
    priority: int = 0
    stream: bool = False
    include_usage: bool = False  # streamed: a usage chunk at the end
    continuous_usage: bool = False  # streamed: usage so far in every chunk (vLLM)
    use_beam_search: bool = False  # n beams instead of n samples (vLLM)
    length_penalty: float = 1.0
    echo: bool = False  # completions: the prompt before the text
    prompt_only: bool = False  # echo with max_tokens=0: the generated token is dropped
    tool_mode: ToolMode | None = None  # chat with tools (not "none")
    reasoning: ReasoningParser | None = None  # chat with a reasoning parser

    @property
    def id_prefix(self) -> str:
        return ID_PREFIXES[self.kind]
