"""kiln's runtime: the engine, its scheduler and KV cache, the offline API and the server."""

from engine.request import LoRARequest, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "EngineSettings"]


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when these are used.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "EngineSettings":
        from engine.config import EngineSettings

        return EngineSettings
    raise AttributeError(name)
