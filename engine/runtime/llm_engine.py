"""LLMEngine: one model, its KV cache, scheduler, runner and sampler, driven step by step.

Both the offline `LLM` and the server's `AsyncEngine` drive this class. The parts are built
by engine/runtime/builder.py; a step's results are turned into outputs by
engine/runtime/output_processor.py.

The loop (`step`): schedule -> launch -> process the previous step's results. With
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
import uuid
from dataclasses import dataclass

from engine.config.settings import EngineSettings
from engine.core.request import (
    FinishReason,
    InvalidRequestError,
    LoRARequest,
    PoolingParams,
    Request,
    RequestOutput,
    SamplingParams,
    check_logprobs_limit,
)
from engine.core.request_kinds import make_task
from engine.core.sched.scheduler_output import SchedulerOutput
from engine.core.sched.spec.decoder import verify_overlaps
from engine.lora.adapters import attach_lora, load_lora, unload_lora
from engine.runtime.builder import PARTS, EngineBuilder
from engine.runtime.detokenizer import Detokenizer, init_offsets
from engine.runtime.output_processor import OutputProcessor
from engine.worker.model_runner import PendingStep

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
        position on the host (engine/core/sched/spec/decoder.py verify_overlaps): how many drafts
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
        self.outputs: OutputProcessor | None = None
        parts = EngineBuilder(settings).build()
        for name in PARTS:
            setattr(self, name, getattr(parts, name))
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids, self.max_model_len)
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
        """(Replaceable: the output processor detokenises with the new one from the next step.)"""
        self._tokenizer = tokenizer
        if self.outputs is not None:
            self.outputs.detokenizer = Detokenizer(tokenizer, self.eos_token_ids, self.max_model_len,
                                                   text=not self.outputs.defer_text)

    # ---- requests ----
    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:3]}",
                                      "prompt")
        return None, ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> Request:
        """Queue a request. Its task (engine/core/request_kinds.py) comes from params and `pooling`: with
        `pooling` it is an embedding request (RequestOutput.embedding; params are ignored)."""
        task = make_task(params, pooling)
        task.check(self.model_config, self.model_dir.name)
        params = task.params(params)
        params.validate()
        check_logprobs_limit(params, self.settings.max_logprobs)
        vocab = self.model_config.vocab_size
        for name, ids in params.token_id_fields():
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token ids must be in [0, {vocab}); got {bad[:3]}", name)
        text, ids = self.encode_prompt(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
            text = None  # the text no longer matches the tokens
        request = Request(request_id=request_id or uuid.uuid4().hex, prompt=text, prompt_token_ids=ids,
                          params=params, priority=priority, task=task)
        if params.structured_outputs is not None:
            request.grammars = self.structured_output.matchers(params.structured_outputs, params.n, ids)
        if lora_request is not None:
            attach_lora(self.lora, request, lora_request)
        self.scheduler.add_request(request)
        for seq in request.seqs:
            init_offsets(seq)
        return request

    def check_room(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A prompt of this length can grow by max_tokens within max_model_len (beam search checks
        up front: its requests are one token each)."""
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                                      f"max_model_len={self.max_model_len}", "max_tokens")

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load a LoRA adapter into a free slot (call between steps)."""
        return load_lora(self.lora, name, path)

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no unfinished request uses (call between steps)."""
        unload_lora(self.lora, self.scheduler.requests.values(), name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        self.scheduler.pop_finished_request(request_id)
        return self.outputs.hand_out(request)

    def finish_seq_early(self, request_id: str, index: int, stop_reason: int | str | None) -> None:
        """Finish sample `index` of a request whose text hit a stop string found off the engine
        thread (defer_text): its blocks are freed now; its outputs were handed out there."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.sample_index == index:
                self.scheduler.finish_seq(seq, FinishReason.STOP, stop_reason)
        if request.is_finished:
            request.finished_time = time.monotonic()
            self.scheduler.pop_finished_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then process the previous one's results (or, in the
        serial loop, this one's)."""
        sched = self.scheduler.schedule()
        previous = self._inflight
        defer = previous is not None and _defers_sampling(sched)
        launched = None if sched.is_empty else self._launch(sched, defer)
        self._inflight = launched
        outputs = self._process(previous) if previous is not None else []
        if launched is None:
            return outputs
        if defer:  # the previous step's tokens have advanced the grammars: sample now
            self._sample(launched)
        if not self.async_scheduling or _needs_serial(sched):
            self._inflight = None
            outputs += self._process(launched)
        return outputs

    def _launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> _Launched:
        t0 = time.perf_counter()
        if self.block_swapper is not None:
            measured = self.block_swapper.measurement()  # an earlier step's copies, if done
            if measured is not None:
                self.swap_space.observe_swap(*measured)
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            # Queued on the swap stream; the compute stream waits for them before this step's
            # copy-on-write copies and forward (no host sync: the runner's input prep overlaps).
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

    def _process(self, launched: _Launched) -> list[RequestOutput]:
        sched = launched.sched
        outputs, generated = self.outputs.process(sched, launched.pending.result())
        self.last_step = StepStats(sched.num_prefill_tokens, generated, time.perf_counter() - launched.t0)
        if self.swap_space is not None and sched.num_prefill_tokens >= max(MIN_PREFILL_SAMPLE,
                                                                           sched.num_decode_tokens):
            # A prefill-dominated step prices recomputation for auto preemption (SwapSpace).
            self.swap_space.observe_prefill(sched.num_tokens, self.last_step.duration)
        self.num_prompt_tokens_total += sched.num_prefill_tokens
        self.num_generation_tokens_total += generated
        return outputs

    def fail_all_requests(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request with an error (after an engine-loop crash): no one hangs.

        Returns their final outputs; the pools are left fully free.
        """
        self._inflight = None  # its results are not wanted any more
        return self.outputs.fail_all(message)

    def warm_prefixes(self, token_id_lists: list[list[int]]) -> int:
        """Compute these prefixes' KV and pin their full blocks for good (engine/runtime/warm_prefixes.py)."""
        from engine.runtime.warm_prefixes import warm_prefixes

        return warm_prefixes(self, token_id_lists)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-idle KV block (blocks in use keep theirs): later prompts recompute
        their prefixes. Returns how many blocks were dropped (vLLM's `reset_prefix_cache`)."""
        return self.pool.reset_prefix_cache()

    def _output(self, request: Request) -> RequestOutput | None:
        return self.outputs.output(request)

    # ---- invariants ----
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def is_idle_and_free(self) -> bool:
        swap_free = self.swap_space is None or self.swap_space.is_fully_free()
        return not self.has_unfinished_requests() and self.pool.is_fully_free() and swap_free
