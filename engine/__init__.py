"""kiln's runtime: the engine, its scheduler and KV cache, the offline API and the server.

Importing it changes nothing in the process: the settings that must precede torch are applied by
each entry point (engine/config/process_setup.py: prepare_process)."""

from engine.core.outputs import RequestOutput
from engine.core.params import LoRARequest, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "EngineSettings"]


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when these are used; engine.entrypoints.llm prepares
    # the process before it imports torch.
    if name == "LLM":
        from engine.entrypoints.llm import LLM

        return LLM
    if name == "EngineSettings":
        from engine.config.settings import EngineSettings

        return EngineSettings
    raise AttributeError(name)
