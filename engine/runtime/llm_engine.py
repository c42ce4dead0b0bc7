"""LLMEngine: the engine's front, holding an EngineCore, as vLLM v1 splits them.

The core (engine/runtime/engine_core.py `EngineCore`) owns the scheduler, the runner (or the
tensor-parallel executor), the swap space and the one update pass; it speaks in token ids and
`RequestUpdate`s. The front does what is about text and callers: input processing (the
`Admission` of engine/runtime/admission.py turns a prompt and its params into an admitted
request) and output processing (an inline `OutputProcessor`, engine/runtime/output_processor.py:
detokenising, stop strings, building `RequestOutput`s).

The offline `LLM` runs front and core inline: `step()` is `core.step()` with its updates
turned into outputs at once, what the output side ended (a stop string, a failed output) fed
back to the core. The server's `AsyncEngine` (engine/runtime/async_engine.py) uses the front
for its admission and start-up facts only: it runs `engine.core` on its step thread and its own
OutputProcessor on an output thread.

Everything is built once by engine/runtime/builder.py; `LLMEngine.from_settings` wires the
parts into a core and a front (the model side is reached through `engine.core`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from engine.config.generation_config import GenerationDefaults
from engine.config.settings import EngineSettings
from engine.core import admission_rules as rules
from engine.core.outputs import RequestOutput, RequestUpdate
from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from engine.core.request import Request
from engine.core.sched.step_timeline import StepTimeline
from engine.runtime.admission import Admission, AdmittedRequest
from engine.runtime.builder import EngineBuilder
from engine.runtime.engine_core import EngineCore
from engine.runtime.output_processor import OutputProcessor
from engine.structured_output.grammars import StructuredOutputCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    """The front over an EngineCore: admission in, outputs out; see the module docstring."""

    def __init__(
        self,
        core: EngineCore,
        admission: Admission,
        tokenizer: Any,
        *,
        settings: EngineSettings,
        model_dir: Path,
        model_config: Any,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        generation_defaults: GenerationDefaults,
        structured_output: StructuredOutputCompiler,
        startup_seconds: float = 0.0,
    ) -> None:
        self.core = core
        self.admission = admission
        self.outputs = OutputProcessor(tokenizer)  # the inline output side (step)
        self._tokenizer = tokenizer
        # What the API side reads (engine/runtime/engine_info.py EngineInfo), fixed at start-up:
        self.settings = settings
        self.model_dir = model_dir
        self.model_config = model_config  # engine/models/config.py ModelConfig
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.generation_defaults = generation_defaults
        self.structured_output = structured_output  # (admission compiles with it; the core makes matchers)
        self.startup_seconds = startup_seconds

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "LLMEngine":
        """Build every part (engine/runtime/builder.py) and wire them into a core and its front."""
        t0 = time.perf_counter()
        parts = EngineBuilder(settings).build()
        core = EngineCore(
            scheduler=parts.scheduler,
            runner=parts.runner,
            pool=parts.pool,
            swap_space=parts.swap_space,
            block_swapper=parts.block_swapper,
            draft_runner=parts.draft_runner,
            executor=parts.executor,
            async_scheduling=parts.async_scheduling,
            structured_output=parts.structured_output,
            lora=parts.lora,
            model=parts.model,
            kv_cache=parts.kv_cache,
            backend=parts.backend,
            device=parts.device,
            dtype=parts.dtype,
            cpu_threads=parts.cpu_threads,
            compile_seconds=parts.compile_seconds,
            capture_seconds=parts.capture_seconds,
            kv_tiers=parts.kv_tiers,
            timeline=StepTimeline(settings.step_timeline) if settings.step_timeline is not None else None,
        )
        admission = Admission(
            parts.model_config,
            parts.model_dir.name,
            parts.max_model_len,
            settings.max_num_seqs,
            settings.max_logprobs,
            parts.tokenizer,
            parts.structured_output,
            parts.eos_token_ids,
            kv=parts.scheduler.kv,
            lora=parts.lora,
        )
        startup_seconds = time.perf_counter() - t0
        logger.info(
            "engine ready: %s (%s, %s) on %s, %d KV blocks of %d, max_model_len %d, backend %s, "
            "async scheduling %s, %.1fs",
            parts.model_dir,
            parts.model_config.model_type,
            str(parts.dtype).removeprefix("torch."),
            parts.device,
            parts.num_blocks - 1,
            settings.block_size,
            parts.max_model_len,
            parts.backend.name,
            "on" if parts.async_scheduling else "off",
            startup_seconds,
        )
        return cls(
            core,
            admission,
            parts.tokenizer,
            settings=settings,
            model_dir=parts.model_dir,
            model_config=parts.model_config,
            max_model_len=parts.max_model_len,
            eos_token_ids=parts.eos_token_ids,
            generation_defaults=parts.generation_defaults,
            structured_output=parts.structured_output,
            startup_seconds=startup_seconds,
        )

    @property
    def tokenizer(self):
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        """(Replaceable: admission and the inline output side use the new one from now on.)"""
        self._tokenizer = tokenizer
        self.admission.tokenizer = tokenizer
        self.outputs.set_tokenizer(tokenizer)

    # ---- requests ----
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> Request:
        """Admit and queue a request whose outputs `step` hands out. Its task comes from params and
        `pooling`: with `pooling` it is an embedding request (RequestOutput.embedding; params are
        ignored). InvalidRequestError if admission refuses it."""
        return self.submit(self.admission.admit(prompt, params, request_id, priority, lora_request, pooling))

    def submit(self, admitted: AdmittedRequest) -> Request:
        """Queue an admitted request whose outputs `step` hands out (its id unused: the caller's thread
        is the step's, so the scheduler's requests are the ids in use)."""
        rules.request_id_free(admitted.request_id, self.core.scheduler.requests)
        request = self.core.add_admitted(admitted)
        self.outputs.add(admitted)
        return request

    def weight_copy_bytes(self) -> int:
        """Bytes of the second (packed GEMM) copies of weights the model holds (/metrics)."""
        from engine.worker.cpu_gemm_weights import packed_copy_bytes

        return packed_copy_bytes(self.core.model)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its final output (None: no such request)."""
        update = self.core.abort(request_id)
        if update is None:
            return None
        outputs = self._inline([update])
        return outputs[0] if outputs else None

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """core.step(), its updates turned into outputs here (the offline path)."""
        return self._inline(self.core.step())

    def _inline(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """The inline output side: updates -> outputs; what it ended is ended in the core at once."""
        processed = self.outputs.process(updates)
        for request_id, index, stop in processed.stopped:
            self.core.finish_by_text(request_id, index, stop)
        for request_id in processed.failed:  # (its output, an error, is handed out already)
            self.core.abort(request_id)
        return processed.outputs

    def fail_all_requests(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request with an error (after an engine-loop crash): no one hangs.

        Returns their final outputs; the pools are left fully free.
        """
        return self._inline(self.core.fail_all(message))

    def warm_prefixes(self, token_id_lists: list[list[int]]) -> int:
        """Admit these prefixes and have the core compute and pin their full blocks for good
        (engine/runtime/warm_prefixes.py, EngineCore.warm_prefixes)."""
        from engine.runtime.warm_prefixes import warm_prefixes

        return warm_prefixes(self, token_id_lists)
