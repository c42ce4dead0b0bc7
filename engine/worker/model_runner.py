"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

The step's inputs are written into persistent buffers (engine/worker/input_buffers.py) by the step
builder (engine/worker/step_builder.py), so captured CUDA graphs (engine/worker/decode_graphs.py,
compiler/compilation/capture.py) replay over the same storage. The forward gets the attention metadata and
the forward context (engine/worker/step_features.py: other features' step inputs). After the forward,
the sampler picks tokens on the device, and each task that reads hidden states (engine/core/request_kinds.py)
takes what it needs; `PendingStep` gathers both for the host.

Unless `enforce_eager`, the forward is compiled (Inductor) and, on a GPU, decode steps
replay CUDA graphs: the smallest captured bucket >= the batch, with unused rows padded so they
write nothing (slot -1) and read nothing (length 0). Prefill/mixed steps and batches above the
largest bucket run compiled without graphs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from compiler.compilation.capture import MIN_COMPILED_ROWS, compile_forward, mark_static_dims
from engine.core.outputs import SamplerOutput
from engine.core.params import SamplingParams
from engine.core.sched.scheduler_output import SchedulerOutput
from engine.layers.kv_cache import KVCache
from engine.spec_decode.verify import VerifyOutcome, verify_outcome
from engine.structured_output.step_bitmask import StepBitmask
from engine.worker.decode_graphs import DecodeGraphRunner
from engine.worker.host_upload import upload
from engine.worker.input_buffers import InputBuffers
from engine.worker.sample.sampler import Sampler, SampleRow
from engine.worker.sample.sampler_output import HostCopy, LastSampled, PendingSample
from engine.worker.step_builder import StepBuilder, StepInputs
from engine.worker.step_features import StepFeatures
from engine.worker.task_reads import read_task

if TYPE_CHECKING:
    from engine.spec_decode.proposal import Proposal

logger = logging.getLogger(__name__)


class DeviceProposer(Protocol):
    """What a launch calls of its device proposer (engine/spec_decode/ DraftModelProposer, EagleProposer)."""

    def propose(self, sched: SchedulerOutput, target: StepBuilder) -> Proposal | None: ...

    def sampled(self, sched: SchedulerOutput, pending: PendingStep) -> None: ...


class ModelRunner:
    executor: Any = None  # the tensor-parallel executor (TensorParallelRunner's), set by the builder

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        sampler: Sampler,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Room for the padding rows of compiled steps (>= MIN_COMPILED_ROWS tokens and sequences).
        max_seqs = max(max_num_seqs, MIN_COMPILED_ROWS + 4) + 1
        max_tokens = max(max_num_batched_tokens, max_seqs) + MIN_COMPILED_ROWS + 2
        self.buffers = InputBuffers(max_tokens, max_seqs, self.max_blocks_per_seq, device)
        self.builder = StepBuilder(self.buffers, StepFeatures.for_model(model, max_tokens, device), block_size)
        self.forward_fn = model.forward  # replaced by the compiled forward (compiler/compilation/capture.py)
        self.graph_runner: DecodeGraphRunner | None = None  # set when decode CUDA graphs are captured
        self.num_forwards = 0  # steps launched with rows (graph replays among them: graph_runner.num_replays)
        # A device proposer (engine/spec_decode/: a draft model, an EAGLE head): it drafts inside
        # each launch, before the forward that verifies its drafts.
        self.spec: DeviceProposer | None = None
        # A proposer's own runner (a draft model's, an EAGLE head's): its graphs end at the hidden
        # states, the proposer computes the logits it samples from (set by the proposer).
        self.hidden_only = False
        # Every cache tensor indexed by the scheduler's block ids: a draft's shares them, so a
        # copy-on-write copies its block too.
        self.block_copy_caches = [kv_cache.tensor]

    @property
    def compiled(self) -> bool:
        """forward_fn is torch.compile'd: steps are padded, block tables full width."""
        return self.builder.compiled

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Write the step's inputs into the static buffers (and upload them)."""
        return self.builder.build(sched)

    # ---- compile / capture (start-up) ----
    @torch.inference_mode()
    def compile_model(self) -> float:
        """torch.compile the forward and compile its three graphs now: one token (batch-1 decode,
        static shapes), decode-shaped (one token per sequence, batch size symbolic) and general.

        Returns seconds. The warm-up steps are all padding (slot -1, length 0): they write only
        the null block. They are traced without duck sizing, so no coincidence of sizes (tokens,
        sequences + 1, KV blocks) ties two dimensions to one symbol.

        The KV cache's block count is symbolic (its other dimensions static), so a persistent
        compile cache is hit again whatever the profiled pool size of the next start.
        """
        t0 = time.perf_counter()
        mark_static_dims([self.kv_cache.tensor], dims=(0, 1, 3, 4, 5))
        torch._dynamo.mark_dynamic(self.kv_cache.tensor, 2)
        self.forward_fn = compile_forward(self.model.forward)
        self.builder.compiled = True
        # Float constants (norm eps, attention scale) specialised up front: left symbolic, Dynamo
        # traces each graph twice (it restarts once they are found to be constants).
        with (
            torch.fx.experimental._config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            self._compile_warmup_steps()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _compile_warmup_steps(self) -> None:
        buf = self.buffers
        for num_tokens, num_seqs, max_q in ((1, 1, 1), (3, 3, 1), (5, 2, 4)):
            self.builder.fill_padding_step(num_seqs, num_tokens)
            meta = self.builder.compiled_meta(num_tokens, num_seqs, max_q, max_q)
            self.forward_fn(
                buf.input_ids[:num_tokens],
                buf.positions[:num_tokens],
                self.kv_cache.tensor,
                meta,
                self.builder.features.context(num_tokens),
            )

    def capture_graphs(
        self, sizes: list[int], device_reads_lengths: bool, simulate: bool = False, max_query: int = 1
    ) -> float:
        """Capture one decode graph per batch bucket (CUDA only); returns seconds.

        simulate=True (tests on the CPU): no CUDA graphs, each "replay" runs the graph body
        eagerly over the same static buffers, so bucketing and padding are exercised anyway.
        max_query > 1 (speculative decoding): verify steps of up to that many tokens per sequence
        replay graphs too.
        """
        if not self.builder.compiled:
            raise RuntimeError("capture_graphs needs the compiled forward: call compile_model first")
        if self.device.type != "cuda" and not simulate:
            raise RuntimeError("CUDA graphs need device='cuda'")
        sizes = sorted({s for s in sizes if s >= 1})
        if not sizes:
            return 0.0
        if sizes[-1] > self.buffers.max_seqs - 1:
            raise ValueError(f"cuda_graph_sizes: {sizes[-1]} is larger than max_num_seqs")
        self.graph_runner = DecodeGraphRunner(
            self._decode_graph_body,
            lambda rows, q: self.builder.fill_padding_step(rows, q=q),
            sizes,
            max_model_len=self.max_model_len,
            device_reads_lengths=device_reads_lengths,
            hidden_size=self.model.config.hidden_size,
            dtype=self.kv_cache.model_dtype,
            device=self.device,
            simulate=simulate,
            max_query=max_query,
            max_tokens=self.graph_token_capacity(),
            logits=not self.hidden_only,
        )
        self.builder.graph_key = self.graph_runner.key_for
        return self.graph_runner.capture_startup()

    def graph_token_capacity(self) -> int:
        """The most tokens a captured step may read: the input buffers' rows, and those of the
        model's static hidden-state buffers (EAGLE-3's aux_hidden on the target, an EAGLE head's
        hidden_in). A verify bucket (rows * q tokens) can exceed them."""
        rows = self.buffers.max_tokens
        for name in ("aux_hidden", "hidden_in"):
            buffer = getattr(self.model, name, None)
            if isinstance(buffer, torch.Tensor):
                rows = min(rows, buffer.shape[0])
        return rows

    def _decode_graph_body(
        self, rows: int, max_seq_len: int, q: int = 1, logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode step of `rows` sequences (a verify step: up to q tokens each) over the static
        buffers, as a graph captures it: compiled forward, then (unless logits=False: a
        proposer's runner) logits. Returns (final hidden states, logits or None)."""
        buf = self.buffers
        tokens = rows * q
        meta = self.builder.compiled_meta(tokens, rows, q, max_seq_len, num_decodes=rows if q == 1 else 0)
        ctx = self.builder.features.context(tokens)  # (static buffers too: the graph reads them in place)
        hidden = self.forward_fn(buf.input_ids[:tokens], buf.positions[:tokens], self.kv_cache.tensor, meta, ctx)
        return hidden, self.model.compute_logits(hidden) if logits else None

    # ---- the step ----
    @torch.inference_mode()
    def launch(
        self, sched: SchedulerOutput, defer_sampling: bool = False, bitmask: StepBitmask | None = None
    ) -> "PendingStep":
        """Queue one step on the device; its sampled tokens stay there (they feed the next step's
        placeholders) and come to the host when PendingStep.result() is called.

        defer_sampling: queue the forward and the logits only; `sample(sched, pending)` samples
        later (overlap scheduling: a grammar's bitmask needs the previous step's tokens, which the
        host processes while the device runs this forward). bitmask: the constrained rows'
        allowed tokens, which the core fills (engine/structured_output/step_bitmask.py)."""
        if sched.blocks_to_copy:
            src = upload([a for a, _ in sched.blocks_to_copy], torch.int64, self.device)
            dst = upload([b for _, b in sched.blocks_to_copy], torch.int64, self.device)
            for cache in self.block_copy_caches:
                torch.ops.kiln.copy_blocks(cache, src, dst)
        pending = PendingStep()
        if not sched.seqs:
            pending.sample = PendingSample.empty(self.device)
            return pending
        step = self.prepare(sched)
        self.num_forwards += 1
        if self.spec is not None:
            pending.proposal = self.spec.propose(sched, self.builder)
            if pending.proposal is not None:
                pending.proposal.write_inputs(self.buffers)
                pending.proposal.patch_rows(step.rows)
        if self.graph_runner is not None and self.graph_runner.can_replay(step):
            hidden, tokens = self.graph_runner.replay(step)
            n = len(step.rows)
            pending.hidden = hidden[:n]
            if not defer_sampling and all([r.plain for r in step.rows]):
                # argmax computed in the graph; -1 marks a row with non-finite logits (the sampler's rule)
                pending.sample = PendingSample(tokens[:n], HostCopy(tokens[:n]), {})
                return self._remember(sched, pending)
            # the sampler needs the logits: one more LM-head matmul over the graph's hidden states
            pending.deferred = (self.model.compute_logits(hidden[:n]), step.rows)
        else:
            hidden = pending.hidden = self.run_model(step)
            if step.rows:
                n = len(step.sample_indices)
                # A decode step samples rows 0..n-1 in order: a view, no gather (nor an index upload).
                picked = (
                    hidden[:n]
                    if step.sample_indices == list(range(n))
                    else hidden[upload(step.sample_indices, torch.int64, self.device)]
                )
                pending.deferred = (self.model.compute_logits(picked), step.rows)
            for task, seq_id, plan in step.reads:
                pending.task_results[seq_id] = read_task(task, self.model, hidden, plan)
        # (sampled at once: nothing of this step can have finished since it was scheduled)
        return pending if defer_sampling else self._sample(sched, pending, (), bitmask)

    @torch.inference_mode()
    def sample(
        self,
        sched: SchedulerOutput,
        pending: "PendingStep",
        finished: set[int] | frozenset[int] = frozenset(),
        bitmask: StepBitmask | None = None,
        histories: list[tuple[int, int, list[int]]] = (),
    ) -> "PendingStep":
        """Sample a launched step's logits. A sequence that finished since the launch (deferred
        sampling: the previous step's tokens ended it; the core names them in `finished`) gets a
        plain argmax row instead of its own: its token is discarded, and its grammar or logits
        processors are not asked again. histories: (seq id, from, tokens) deltas of the rows'
        histories since the launch (the core learnt the previous step's tokens meanwhile)."""
        states = self.builder.states
        for seq_id, start, tokens in histories:
            states.update_history(seq_id, start, tokens)
        return self._sample(sched, pending, finished, bitmask)

    def _sample(
        self, sched: SchedulerOutput, pending: "PendingStep", finished, bitmask: StepBitmask | None = None
    ) -> "PendingStep":
        if pending.deferred is None:
            pending.sample = PendingSample.empty(self.device)
            return self._remember(sched, pending)
        logits, rows = pending.deferred
        pending.deferred = None
        if finished:
            rows = [_DISCARDED if r.key in finished else r for r in rows]
        drafts = pending.proposal.draft_probs(self.device) if pending.proposal is not None else None
        pending.sample = self.sampler.launch(logits, rows, self.builder.last_sampled, drafts, bitmask)
        return self._remember(sched, pending)

    def _remember(self, sched: SchedulerOutput, pending: "PendingStep") -> "PendingStep":
        """Keep the step's device tokens (and its sequences, which tell each one's row in them):
        the next step's placeholders read from there. Nothing per row here: the rows are looked
        up only when a placeholder needs them. A device proposer reads the step first (an EAGLE
        head's catch-up over its hidden states and sampled tokens)."""
        if pending.proposal is not None:  # (what the next step, if launched before this one is processed, reads)
            pending.verify = verify_outcome(sched, pending.sample.tokens, pending.proposal)
        if self.spec is not None:
            self.spec.sampled(sched, pending)
        pending.hidden = None
        decode = sched.num_prefill_tokens == 0 and sched.num_decode_tokens == len(sched.seqs)
        self.builder.last_sampled = LastSampled(pending.sample.tokens, sched.seqs, decode, pending.verify)
        return pending

    def run_model(self, step: StepInputs) -> torch.Tensor:
        buf = self.buffers
        return self.forward_fn(
            buf.input_ids[: step.num_tokens],
            buf.positions[: step.num_tokens],
            self.kv_cache.tensor,
            step.meta,
            step.ctx,
        )


class PendingStep:
    """A launched step: its sample on the way to the host, plus what tasks read off its hidden
    states (seq id -> result: prompt logprobs, an embedding chunk's hidden state; engine/core/request_kinds.py)."""

    def __init__(self) -> None:
        self.sample: PendingSample | None = None  # set once sampled
        self.deferred: tuple[torch.Tensor, list[SampleRow]] | None = None  # (logits, rows) not sampled yet
        self.task_results: dict[int, Any] = {}
        self.proposal: Proposal | None = None  # the launch's device drafts (engine/spec_decode/proposal.py)
        self.hidden: torch.Tensor | None = None  # the step's final hidden states, until it is sampled
        # its verify records' outcome on the device (engine/spec_decode/verify.py)
        self.verify: VerifyOutcome | None = None

    def result(self) -> SamplerOutput:
        out = self.sample.result()
        out.task_results = self.task_results
        if self.proposal is not None:  # (the core compares the drafts with the sampled tokens)
            out.drafts = self.proposal.drafts_by_seq()
        return out


# The row of a sequence that finished before its launched step was sampled (its token is discarded).
_DISCARDED = SampleRow(SamplingParams(temperature=0.0), [], 0, 0)
