"""kiln's runtime: the engine, its scheduler and KV cache, the offline API and the server."""

from engine.worker.cpu_isa import set_cpu_isa_limit
from engine.worker.cpu_threads import set_openmp_spin

# Before anything loads torch (its runtimes read these once): how long idle OpenMP threads spin
# before sleeping, and KILN_CPU_ISA's limit on torch's kernels.
set_openmp_spin()
set_cpu_isa_limit()

from engine.core.request import LoRARequest, RequestOutput, SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "EngineSettings"]


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when these are used.
    if name == "LLM":
        from engine.entrypoints.llm import LLM

        return LLM
    if name == "EngineSettings":
        from engine.config.settings import EngineSettings

        return EngineSettings
    raise AttributeError(name)
