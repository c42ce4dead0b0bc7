"""EngineCore: the scheduler and the model runner, stepped: schedule -> launch -> update.

The core speaks in token ids and `RequestUpdate`s (engine/core/outputs.py), never text: it
takes admitted requests (engine/runtime/admission.py), runs steps and returns each step's
updates from its one pass (Scheduler.update_from_output: tokens, stops, grammars, freed
blocks). Turning updates into `RequestOutput`s (detokenising, stop strings) is the front's
work: `LLMEngine` (engine/runtime/llm_engine.py) does it inline after each step for the
offline `LLM`; the server's `AsyncEngine` runs the core on its step thread and its own
OutputProcessor on an output thread. What the output side ends (a stop string, a failed
output) comes back to the core through `finish_by_text` / `abort`.

The parts (scheduler, runner, pool, swap space, the executor with tensor parallelism) are
built by engine/runtime/builder.py and handed in as constructor arguments: the core imports no
model, layer or executor code.

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
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.outputs import RequestUpdate
from engine.core.params import LoRARequest
from engine.core.request import Request
from engine.core.sched.scheduler import Scheduler
from engine.core.sched.scheduler_output import SchedulerOutput
from engine.core.sched.step_timeline import StepTimeline
from engine.lora.adapters import LoRAManager, attach_lora, load_lora, unload_lora
from engine.runtime.admission import AdmittedRequest
from engine.runtime.kv_tiers import KVTiers
from engine.spec_decode.sched.decoder import verify_overlaps
from engine.structured_output.grammars import StructuredOutputCompiler
from engine.structured_output.step_bitmask import StepBitmask, step_bitmask
from engine.worker.cpu_threads import ThreadPlan
from engine.worker.model_runner import ModelRunner, PendingStep

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
        if s.constrained or s.params.logits_processors:
            return True
    return False


class EngineCore:
    """Schedule -> execute -> update over token ids; see the module docstring."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: ModelRunner,
        pool: BlockPool,
        swap_space: SwapSpace | None,
        block_swapper: Any,
        draft_runner: ModelRunner | None,
        executor: Any,
        async_scheduling: bool,
        structured_output: StructuredOutputCompiler,
        lora: LoRAManager | None,
        model: Any,
        kv_cache: Any,
        backend: Any,
        device: torch.device,
        dtype: torch.dtype,
        cpu_threads: ThreadPlan,
        compile_seconds: float = 0.0,
        capture_seconds: float = 0.0,
        kv_tiers: KVTiers | None = None,
        timeline: StepTimeline | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner  # (TensorParallelRunner with tensor parallelism)
        self.pool = pool
        self.swap_space = swap_space
        # engine/worker/block_swapper.py BlockSwapper (or a SwapGroup, or the TP executor's); None without swap space
        self.block_swapper = block_swapper
        # Speculative decoding's draft model or EAGLE head: its runner (driven inside the target
        # runner's launch, engine/spec_decode/), or None.
        self.draft_runner = draft_runner
        self.executor = executor  # engine/executor/tp_executor.py TensorParallelExecutor, or None
        self.async_scheduling = async_scheduling
        self.structured_output = structured_output  # (makes a request's grammar matchers)
        self.lora = lora
        # What the runner runs, built once (read by benches and tests; the core only launches the runner):
        self.model = model  # the model (wrapped by the executor with tensor parallelism)
        self.kv_cache = kv_cache  # engine/layers/kv_cache.py KVCache
        self.backend = backend  # the attention backend (engine/layers/attention/)
        self.device = device
        self.dtype = dtype
        self.cpu_threads = cpu_threads
        self.compile_seconds = compile_seconds
        self.capture_seconds = capture_seconds
        # The KV tiers under the pool (engine/runtime/kv_tiers.py), or None (the default: off).
        self.kv_tiers = kv_tiers
        self.timeline = timeline  # the step timeline (engine/core/sched/step_timeline.py), or None: off
        self._pinned_blocks: set[int] = set()  # warm-prefix blocks (each pinned once)
        self._inflight: _Launched | None = None  # overlap scheduling: launched, not yet processed
        self.stalled = False  # the last step launched nothing and had nothing in flight
        self.last_step = StepStats()
        self.num_generation_tokens_total = 0
        self.num_prompt_tokens_total = 0

    # ---- requests ----
    def add_admitted(self, admitted: AdmittedRequest) -> Request:
        """Queue an admitted request (whoever admitted it builds its outputs from the updates)."""
        params = admitted.params
        request = Request(
            request_id=admitted.request_id,
            prompt=admitted.prompt,
            prompt_token_ids=admitted.prompt_token_ids,
            params=params,
            arrival_time=admitted.arrival_time,
            priority=admitted.priority,
            task=admitted.task,
        )
        if admitted.grammar is not None:
            assert params.structured_outputs is not None  # (the grammar was compiled from it)
            request.grammars = self.structured_output.matchers(
                admitted.grammar, params.structured_outputs, params.n, admitted.prompt_token_ids
            )
        if admitted.lora_request is not None:
            assert self.lora is not None  # (admission refuses an adapter when LoRA is off)
            attach_lora(self.lora, request, admitted.lora_request)
        held = self.kv_tiers is not None and self.kv_tiers.hold(request)  # (its prefix loads first)
        self.scheduler.add_request(request, held=held)
        return request

    def abort(self, request_id: str) -> RequestUpdate | None:
        """Stop a request now; its last update (None: no such request)."""
        return self.scheduler.abort_request(request_id)

    def finish_by_text(self, request_id: str, index: int, stop: int | str | None) -> None:
        """The output side found a stop string in sample `index` of a request (and handed out its
        end): finish it here, freeing its blocks now."""
        self.scheduler.finish_by_text(request_id, index, stop)

    def fail_all(self, message: str) -> list[RequestUpdate]:
        """Fail every unfinished request with an error (after an engine-loop crash): no one hangs.
        Returns their last updates; the pools are left fully free."""
        self._inflight = None  # its results are not wanted any more
        if self.kv_tiers is not None:
            self.kv_tiers.cancel_all()
        return self.scheduler.fail_all(message)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._inflight is not None
            or (self.kv_tiers is not None and self.kv_tiers.loading)
        )

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load a LoRA adapter into a free slot (call between steps)."""
        return load_lora(self.lora, name, path)

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no unfinished request uses (call between steps)."""
        unload_lora(self.lora, self.scheduler.requests.values(), name)

    # ---- the step ----
    def step(self) -> list[RequestUpdate]:
        """Schedule and launch the next step, then process the previous one's results (or, in the
        serial loop, this one's); returns the requests' updates."""
        tiers = self.kv_tiers
        timeline = self.timeline
        if timeline is not None:
            timeline.begin()
        if tiers is not None:
            # Blocks that turned idle are copied out before loads or this step may overwrite them;
            # finished loads go into the pool (waiting for one when nothing else can run).
            tiers.drain_saves()
            tiers.install_ready(wait=self._inflight is None and not self.scheduler.has_unfinished())
        sched = self.scheduler.schedule()
        if timeline is not None:
            timeline.scheduled(sched)
        if tiers is not None:
            tiers.drain_saves()  # (blocks this schedule preempted or evicted)
        previous = self._inflight
        defer = previous is not None and _defers_sampling(sched)
        launched = None if sched.is_empty else self._launch(sched, defer)
        # Nothing ran and nothing is in flight (e.g. every running request paused): the loop may wait.
        self.stalled = launched is None and previous is None
        self._inflight = launched
        updates = self._process(previous) if previous is not None else []
        if launched is not None:
            if defer:  # the previous step's tokens have advanced the grammars: sample now
                self._sample(launched)
            if not self.async_scheduling or _needs_serial(sched):
                self._inflight = None
                updates += self._process(launched)
        if timeline is not None:
            timeline.end()
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
            pending = self.runner.launch(sched, bitmask=self._bitmask(sched))
            self.scheduler.launched(sched)
        return _Launched(sched, pending, t0)

    def _sample(self, launched: _Launched) -> None:
        """Sample a step launched with its sampling deferred, then advance its sequences (after
        the previous step's processing, so the rows saw exactly the serial loop's history)."""
        sched = launched.sched
        seq_of = self.scheduler.seqs_by_id.get
        finished = {s.seq_id for s in sched.seqs if (seq := seq_of(s.seq_id)) is None or seq.is_finished}
        # The rows read the tokens as they stand now (the previous step's, known since the launch).
        deltas = self.scheduler.deltas
        seqs = self.scheduler.seqs_by_id
        histories = [(s.seq_id, *deltas.history(seqs[s.seq_id])) for s in sched.seqs if s.seq_id not in finished]
        self.runner.sample(sched, launched.pending, finished, self._bitmask(sched, finished), histories)
        self.scheduler.launched(sched)

    def _bitmask(self, sched: SchedulerOutput, finished: set[int] | frozenset[int] = frozenset()) -> StepBitmask | None:
        """The grammar bitmask of the step's constrained rows, from the requests' matchers as they
        stand now (None: nothing in the step is constrained)."""
        if not any([s.constrained for s in sched.seqs]):
            return None
        seqs = self.scheduler.seqs_by_id
        return step_bitmask(
            sched,
            lambda seq_id: seqs[seq_id].request.grammars,
            self.structured_output.vocab_size,
            finished,
        )

    def _process(self, launched: _Launched) -> list[RequestUpdate]:
        sched = launched.sched
        sampled = launched.pending.result()
        t_result = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, sampled)
        generated = self.scheduler.num_generated
        t_done = time.perf_counter()
        self.last_step = StepStats(sched.num_prefill_tokens, generated, t_done - launched.t0)
        if self.timeline is not None:
            self.timeline.processed(launched.t0, t_result, t_done)
        budget = self.scheduler.step_budget
        if budget is not None:  # (the latency target's cost model learns each step's model time)
            budget.observe(sched.num_prefill_tokens, sched.num_decode_tokens, (t_result - launched.t0) * 1e3)
        if self.swap_space is not None and sched.num_prefill_tokens >= max(MIN_PREFILL_SAMPLE, sched.num_decode_tokens):
            # A prefill-dominated step prices recomputation for auto preemption (SwapSpace).
            self.swap_space.observe_prefill(sched.num_tokens, self.last_step.duration)
        self.num_prompt_tokens_total += sched.num_prefill_tokens
        self.num_generation_tokens_total += generated
        return updates

    # ---- the prefix cache ----
    def warm_prefixes(self, admitted: list[AdmittedRequest]) -> int:
        """Run these one-token prefix requests (admitted by the front: engine/runtime/warm_prefixes.py)
        to their end and pin their prompts' full blocks for good. Returns the pool's pinned count."""
        pool = self.pool
        for request in admitted:
            self.add_admitted(request)
        while self.has_unfinished_requests():
            self.step()
        newly = 0
        for request in admitted:
            prefix = request.prompt_token_ids
            blocks, _ = pool.match_prefix(prefix, len(prefix) // pool.block_size)
            for block in blocks:
                if block not in self._pinned_blocks:
                    pool.pin(block)
                    self._pinned_blocks.add(block)
                    newly += 1
        logger.info(
            "warm prefixes: %d prefixes, %d blocks pinned (%d in all, %.0f%% of the KV cache)",
            len(admitted),
            newly,
            pool.num_pinned,
            100 * pool.num_pinned / pool.num_usable,
        )
        return pool.num_pinned

    def reset_prefix_cache(self) -> int:
        """Forget every cached-idle KV block (blocks in use keep theirs): later prompts recompute
        their prefixes (from the KV tiers, when they are on). Returns how many blocks were dropped
        (vLLM's `reset_prefix_cache`)."""
        if self.kv_tiers is not None:
            self.kv_tiers.drain_saves()  # (what leaves the cache goes down first)
        return self.pool.reset_prefix_cache()

    def close(self) -> None:
        """Hand what the KV tiers still queue to them and stop their threads (shutdown)."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
            self.kv_tiers = None
        if self.timeline is not None:
            self.timeline.close()

    # ---- invariants ----
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def is_idle_and_free(self) -> bool:
        swap_free = self.swap_space is None or self.swap_space.is_fully_free()
        return not self.has_unfinished_requests() and self.pool.is_fully_free() and swap_free
