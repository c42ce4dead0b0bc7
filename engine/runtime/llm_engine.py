"""LLMEngine: one model, its KV cache, scheduler, runner and sampler, driven step by step.

Both the offline `LLM` and the server's `AsyncEngine` drive this class. The parts are built
by engine/runtime/builder.py. A request comes in admitted (engine/runtime/admission.py). A
step's results go through the core's one pass (Scheduler.update_from_output: tokens, stops,
grammars, freed blocks) and come out as RequestUpdates (`core_step`); `step` turns them into
RequestOutputs inline (engine/runtime/output_processor.py), the AsyncEngine on its output thread.

The loop (`core_step`): schedule -> launch -> process the previous step's results. With
`async_scheduling` the results of step N are processed after step N+1 was launched, so the
host work overlaps the device's (the scheduler counts each launched step's sampled tokens as
placeholders, and the device feeds the real ids to the next step). A step whose sampling reads
what the host learns from the previous step's tokens (a grammar's bitmask, a logits processor's
history: `_defers_sampling`) launches its forward at once and samples after the previous step
is processed. A step whose tokens must be on the host before the next one can be scheduled
(see `_needs_serial`) is processed at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config.generation_config import GenerationDefaults
from engine.config.settings import EngineSettings
from engine.core import admission_rules as rules
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.outputs import RequestUpdate
from engine.core.request import LoRARequest, PoolingParams, Request, RequestOutput, SamplingParams
from engine.core.sched.scheduler import Scheduler
from engine.core.sched.scheduler_output import SchedulerOutput
from engine.lora.adapters import LoRAManager, attach_lora, load_lora, unload_lora
from engine.runtime.admission import Admission, AdmittedRequest
from engine.runtime.builder import EngineBuilder
from engine.runtime.output_processor import OutputProcessor
from engine.spec_decode.sched.decoder import verify_overlaps
from engine.structured_output.grammars import StructuredOutputCompiler
from engine.worker.cpu_threads import ThreadPlan
from engine.worker.model_runner import ModelRunner, PendingStep
from engine.worker.sample.sampler import Sampler

logger = logging.getLogger(__name__)

# Steps with at least this many prefill tokens (and more prefill than decode) time recomputation.
MIN_PREFILL_SAMPLE = 16


@dataclass
class StepStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    duration: float = 0.0


@dataclass
class _Launched:
    sched: SchedulerOutput
    pending: PendingStep
    t0: float


def _needs_serial(sched: SchedulerOutput) -> bool:
    """This step's tokens must be on the host before the next step can be scheduled, so it is
    processed at once (no overlap, for this step only):
      - a fork (a request with n > 1 at the end of its prompt): its children do not exist until
        the sampled tokens are known; they then decode overlapped like any sequence;
      - n-gram drafts, and model drafts of requests whose sampling reads their history or output
        position on the host (engine/spec_decode/sched/decoder.py verify_overlaps): how many drafts
        are accepted decides the next step's tokens and positions. Other model drafts overlap: the
        sequence advances as if all are kept, and the device moves the next step back;
      - a task that reads hidden states (prompt logprobs, embeddings; prompt steps only): an
        embedding samples no token to stand in for, and prompt logprobs are copied to the host
        inside the launch already (engine/core/request_kinds.py read()), so there is nothing to overlap.
    Penalties overlap (their counts take the previous step's tokens on the device), and so do
    grammars and logits processors, whose sampling waits for the host (`_defers_sampling`)."""
    for s in sched.seqs:
        if s.task.reads_hidden or not (s.advances_at_launch or verify_overlaps(s)):
            return True
    return False


def _defers_sampling(sched: SchedulerOutput) -> bool:
    """The step's sampling reads what the host learns from the previous step's tokens: a grammar's
    bitmask (its matcher advances by them), a logits processor's history (user Python over the
    output token ids). The forward is launched at once, sampling after the previous step is
    processed: the device computes while the host works."""
    for s in sched.seqs:
        if s.grammars or s.params.logits_processors:
            return True
    return False


class LLMEngine:
    def __init__(self, settings: EngineSettings) -> None:
        t0 = time.perf_counter()
        parts = EngineBuilder(settings).build()
        # What the builder made (engine/runtime/builder.py), each part named once here.
        self.settings: EngineSettings = parts.settings
        self.model_dir: Path = parts.model_dir
        self.model_config = parts.model_config  # engine/models/config.py ModelConfig
        self.device: torch.device = parts.device
        self.dtype: torch.dtype = parts.dtype
        self.max_model_len: int = parts.max_model_len
        self.eos_token_ids: tuple[int, ...] = parts.eos_token_ids
        self.generation_defaults: GenerationDefaults = parts.generation_defaults
        self.structured_output: StructuredOutputCompiler = parts.structured_output
        self.model: Any = parts.model  # the model (wrapped by the executor with tensor parallelism)
        self.lora: LoRAManager | None = parts.lora
        self.backend = parts.backend  # the attention backend (engine/layers/attention/)
        self.kv_cache = parts.kv_cache  # engine/layers/kv_cache.py KVCache
        self.pool: BlockPool = parts.pool
        self.swap_space: SwapSpace | None = parts.swap_space
        self.block_swapper = parts.block_swapper  # engine/worker/block_swapper.py BlockSwapper (or the TP executor's)
        self.scheduler: Scheduler = parts.scheduler
        self.sampler: Sampler = parts.sampler
        self.runner: ModelRunner = parts.runner  # (TensorParallelRunner with tensor parallelism)
        # Speculative decoding's draft model or EAGLE head: its runner (driven inside the target
        # runner's launch, engine/spec_decode/), or None.
        self.draft_runner: ModelRunner | None = parts.draft_runner
        self.executor = parts.executor  # engine/executor/tp_executor.py TensorParallelExecutor, or None
        self.compile_seconds: float = parts.compile_seconds
        self.capture_seconds: float = parts.capture_seconds
        self.async_scheduling: bool = parts.async_scheduling
        self.cpu_threads: ThreadPlan = parts.cpu_threads
        self.admission = Admission(self.model_config, self.model_dir.name, self.max_model_len, settings.max_num_seqs,
                                   settings.max_logprobs, parts.tokenizer, self.structured_output, self.eos_token_ids,
                                   kv=self.scheduler.kv, lora=self.lora)
        self.outputs = OutputProcessor(parts.tokenizer)  # the inline output side (step)
        self._tokenizer = parts.tokenizer
        self._pinned_blocks: set[int] = set()  # warm-prefix blocks (each pinned once)
        self._inflight: _Launched | None = None  # overlap scheduling: launched, not yet processed
        self.last_step = StepStats()
        self.num_generation_tokens_total = 0
        self.num_prompt_tokens_total = 0
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready: %s (%s, %s) on %s, %d KV blocks of %d, max_model_len %d, backend %s, "
                    "async scheduling %s, %.1fs", self.model_dir, self.model_config.model_type,
                    str(self.dtype).removeprefix("torch."), self.device, parts.num_blocks - 1,
                    settings.block_size, self.max_model_len, self.backend.name,
                    "on" if self.async_scheduling else "off", self.startup_seconds)

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
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> Request:
        """Admit and queue a request whose outputs `step` hands out. Its task comes from params and
        `pooling`: with `pooling` it is an embedding request (RequestOutput.embedding; params are
        ignored). InvalidRequestError if admission refuses it."""
        return self.submit(self.admission.admit(prompt, params, request_id, priority, lora_request, pooling))

    def submit(self, admitted: AdmittedRequest) -> Request:
        """Queue an admitted request whose outputs `step` hands out (its id unused: the caller's thread
        is the step's, so the scheduler's requests are the ids in use)."""
        rules.request_id_free(admitted.request_id, self.scheduler.requests)
        request = self.add_admitted(admitted)
        self.outputs.add(admitted)
        return request

    def add_admitted(self, admitted: AdmittedRequest) -> Request:
        """Queue an admitted request (the core only: whoever admitted it builds its outputs)."""
        params = admitted.params
        request = Request(request_id=admitted.request_id, prompt=admitted.prompt,
                          prompt_token_ids=admitted.prompt_token_ids, params=params,
                          arrival_time=admitted.arrival_time, priority=admitted.priority, task=admitted.task)
        if admitted.grammar is not None:
            assert params.structured_outputs is not None  # (the grammar was compiled from it)
            request.grammars = self.structured_output.matchers(admitted.grammar, params.structured_outputs,
                                                               params.n, admitted.prompt_token_ids)
        if admitted.lora_request is not None:
            assert self.lora is not None  # (admission refuses an adapter when LoRA is off)
            attach_lora(self.lora, request, admitted.lora_request)
        self.scheduler.add_request(request)
        return request

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load a LoRA adapter into a free slot (call between steps)."""
        return load_lora(self.lora, name, path)

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no unfinished request uses (call between steps)."""
        unload_lora(self.lora, self.scheduler.requests.values(), name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its final output (None: no such request)."""
        update = self.core_abort(request_id)
        if update is None:
            return None
        outputs = self._inline([update])
        return outputs[0] if outputs else None

    def core_abort(self, request_id: str) -> RequestUpdate | None:
        """abort_request, returning the request's last update (for an output side elsewhere)."""
        return self.scheduler.abort_request(request_id)

    def finish_by_text(self, request_id: str, index: int, stop: int | str | None) -> None:
        """The output side found a stop string in sample `index` of a request (and handed out its
        end): finish it in the core, freeing its blocks now."""
        self.scheduler.finish_by_text(request_id, index, stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """core_step, its updates turned into outputs here (the offline path)."""
        return self._inline(self.core_step())

    def _inline(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """The inline output side: updates -> outputs; what it ended is ended in the core at once."""
        processed = self.outputs.process(updates)
        for request_id, index, stop in processed.stopped:
            self.finish_by_text(request_id, index, stop)
        for request_id in processed.failed:  # (its output, an error, is handed out already)
            self.core_abort(request_id)
        return processed.outputs

    def core_step(self) -> list[RequestUpdate]:
        """Schedule and launch the next step, then process the previous one's results (or, in the
        serial loop, this one's); returns the requests' updates."""
        sched = self.scheduler.schedule()
        previous = self._inflight
        defer = previous is not None and _defers_sampling(sched)
        launched = None if sched.is_empty else self._launch(sched, defer)
        self._inflight = launched
        updates = self._process(previous) if previous is not None else []
        if launched is None:
            return updates
        if defer:  # the previous step's tokens have advanced the grammars: sample now
            self._sample(launched)
        if not self.async_scheduling or _needs_serial(sched):
            self._inflight = None
            updates += self._process(launched)
        return updates

    def _launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> _Launched:
        t0 = time.perf_counter()
        if self.block_swapper is not None:
            measured = self.block_swapper.measurement()  # an earlier step's copies, if done
            if measured is not None:
                assert self.swap_space is not None  # (a block swapper is made with the swap space)
                self.swap_space.observe_swap(*measured)
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            # Queued on the swap stream; the compute stream waits for them before this step's
            # copy-on-write copies and forward (no host sync: the runner's input prep overlaps).
            assert self.block_swapper is not None  # (the scheduler swaps only with a swap space)
            self.block_swapper.launch(sched.blocks_to_swap_out, sched.blocks_to_swap_in)
            self.block_swapper.wait()
        if defer_sampling:
            pending = self.runner.launch(sched, defer_sampling=True)
        else:
            pending = self.runner.launch(sched)
            self.scheduler.launched(sched)
        return _Launched(sched, pending, t0)

    def _sample(self, launched: _Launched) -> None:
        """Sample a step launched with its sampling deferred, then advance its sequences (after
        the previous step's processing, so the rows saw exactly the serial loop's history)."""
        self.runner.sample(launched.sched, launched.pending)
        self.scheduler.launched(launched.sched)

    def _process(self, launched: _Launched) -> list[RequestUpdate]:
        sched = launched.sched
        updates = self.scheduler.update_from_output(sched, launched.pending.result())
        generated = self.scheduler.num_generated
        self.last_step = StepStats(sched.num_prefill_tokens, generated, time.perf_counter() - launched.t0)
        if self.swap_space is not None and sched.num_prefill_tokens >= max(MIN_PREFILL_SAMPLE,
                                                                           sched.num_decode_tokens):
            # A prefill-dominated step prices recomputation for auto preemption (SwapSpace).
            self.swap_space.observe_prefill(sched.num_tokens, self.last_step.duration)
        self.num_prompt_tokens_total += sched.num_prefill_tokens
        self.num_generation_tokens_total += generated
        return updates

    def fail_all_requests(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request with an error (after an engine-loop crash): no one hangs.

        Returns their final outputs; the pools are left fully free.
        """
        return self._inline(self.core_fail_all(message))

    def core_fail_all(self, message: str) -> list[RequestUpdate]:
        """fail_all_requests, returning the requests' last updates (for an output side elsewhere)."""
        self._inflight = None  # its results are not wanted any more
        return self.scheduler.fail_all(message)

    def warm_prefixes(self, token_id_lists: list[list[int]]) -> int:
        """Compute these prefixes' KV and pin their full blocks for good (engine/runtime/warm_prefixes.py)."""
        from engine.runtime.warm_prefixes import warm_prefixes

        return warm_prefixes(self, token_id_lists)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-idle KV block (blocks in use keep theirs): later prompts recompute
        their prefixes. Returns how many blocks were dropped (vLLM's `reset_prefix_cache`)."""
        return self.pool.reset_prefix_cache()

    # ---- invariants ----
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def is_idle_and_free(self) -> bool:
        swap_free = self.swap_space is None or self.swap_space.is_fully_free()
        return not self.has_unfinished_requests() and self.pool.is_fully_free() and swap_free
