"""The auto tool-call parsers (vLLM's --tool-call-parser), one registry: name -> ToolParser.
Each family's format is described in its module."""

from __future__ import annotations

from engine.entrypoints.openai.tool_parsers.base import Schemas, ToolCall, ToolParser
from engine.entrypoints.openai.tool_parsers.glm import GLM_PARSERS
from engine.entrypoints.openai.tool_parsers.json_formats import JSON_PARSERS
from engine.entrypoints.openai.tool_parsers.pythonic import PYTHONIC_PARSERS
from engine.entrypoints.openai.tool_parsers.qwen3_xml import QWEN3_XML_PARSERS
from engine.entrypoints.openai.tool_parsers.tagged import TAGGED_PARSERS

REGISTRY: dict[str, ToolParser] = {
    **JSON_PARSERS,
    **PYTHONIC_PARSERS,
    **QWEN3_XML_PARSERS,
    **GLM_PARSERS,
    **TAGGED_PARSERS,
}
TOOL_CALL_PARSERS = tuple(REGISTRY)

__all__ = ["REGISTRY", "TOOL_CALL_PARSERS", "Schemas", "ToolCall", "ToolParser"]
