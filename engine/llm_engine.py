"""LLMEngine: one model, its KV cache, scheduler, runner and sampler, driven step by step.

Both the offline `LLM` and the server's `AsyncEngine` drive this class.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import BackendSpec, get_attention_backend
from engine.config import EngineSettings, export_compile_cache_dir
from engine.detokenizer import check_stop, init_offsets, visible_len
from engine.kv.block_pool import BlockPool
from engine.kv.cache import KVCache
from engine.kv.swap import SwapSpace
from engine.models.config import ModelConfig
from engine.models.loader import load_model, load_tokenizer
from engine.quant.gguf_file import is_gguf
from engine.request import (CompletionOutput, FinishReason, InvalidRequestError, LoRARequest, PoolingParams,
                            Request, RequestOutput, SamplingParams, Sequence)
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, sample_row_ranges
from engine.spec_decode import NgramProposer, SpecDecodeConfig
from engine.structured_output import StructuredOutputCompiler

logger = logging.getLogger(__name__)

# Steps with at least this many prefill tokens (and more prefill than decode) time recomputation.
MIN_PREFILL_SAMPLE = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    duration: float = 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    native = model_config.torch_dtype
    if native in ("bfloat16", "float16"):
        return _DTYPES[native]
    return torch.bfloat16


def resolve_model_dir(settings: EngineSettings) -> Path:
    if settings.model is None:
        from engine.tiny_model import default_model_dir

        return default_model_dir(settings.cache_dir)
    path = Path(settings.model).expanduser()
    if not path.is_dir() and not is_gguf(path):
        raise ValueError(f"model: {settings.model!r} is neither a directory nor a .gguf file (kiln loads HF "
                         "checkpoint directories and GGUF files from disk; no model hub is used)")
    return path


class LLMEngine:
    def __init__(self, settings: EngineSettings) -> None:
        t0 = time.perf_counter()
        self.settings = settings
        self.model_dir = resolve_model_dir(settings)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.model_config, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = load_tokenizer(settings.tokenizer or self.model_dir)
        template = settings.resolved_chat_template()
        if template is not None:
            self.tokenizer.chat_template = template
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.structured_output = StructuredOutputCompiler(self.tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_ids)

        torch.manual_seed(settings.seed)
        if settings.enable_lora and self.model_config.is_moe:
            raise ValueError("enable_lora: LoRA adapters are not supported for mixture-of-experts models")
        self.model = load_model(self.model_dir, self.model_config, self.dtype, self.device,
                                self.max_model_len, settings.load_format, settings.seed,
                                lora=(settings.max_loras, settings.max_lora_rank) if settings.enable_lora else None,
                                quantization=settings.quantization)
        self.lora = self._make_lora_manager()
        self.backend = get_attention_backend(settings.attention_backend, BackendSpec(
            device=self.device, dtype=self.dtype, head_dim=self.model_config.head_dim,
            block_size=settings.block_size, kernel_cache_dir=settings.resolved_kernel_cache_dir(),
            compile=not settings.enforce_eager))
        self.model.set_backend(self.backend)
        num_blocks = self._num_kv_blocks()
        cfg = self.model_config
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, settings.block_size, cfg.num_kv_heads,
                                cfg.head_dim, self.dtype, self.device)
        self.pool = BlockPool(num_blocks, settings.block_size, settings.enable_prefix_caching)
        max_tokens_per_seq = self.pool.num_usable * settings.block_size
        if self.max_model_len > max_tokens_per_seq:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache can hold "
                f"({max_tokens_per_seq} tokens in {self.pool.num_usable} blocks of {settings.block_size}); "
                "lower max_model_len or give the cache more memory (num_gpu_blocks, "
                "gpu_memory_utilization, kv_cache_memory_gb)")
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=self._token_budget(),
            max_model_len=self.max_model_len,
            block_size=settings.block_size,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            preemption_mode=settings.preemption_mode,
            reserved_blocks_fraction=settings.reserved_blocks_fraction,
            reserved_priority=settings.reserved_priority,
        ), self.pool, self._make_swap_space(), self._make_proposer())
        self.sampler = Sampler(self.device, self.eos_token_ids, settings.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.device, settings.block_size,
                                  settings.max_num_seqs, self._token_budget(), self.max_model_len)
        self.compile_seconds, self.capture_seconds = self._compile_and_capture()
        self.last_step = StepStats()
        self.num_generation_tokens_total = 0
        self.num_prompt_tokens_total = 0
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready: %s (%s, %s) on %s, %d KV blocks of %d, max_model_len %d, backend %s, %.1fs",
                    self.model_dir, cfg.model_type, str(self.dtype).removeprefix("torch."), self.device,
                    num_blocks - 1, settings.block_size, self.max_model_len, self.backend.name,
                    self.startup_seconds)

    def _compile_and_capture(self) -> tuple[float, float]:
        """torch.compile the forward (persistent Inductor cache) and, on a GPU, capture the decode
        CUDA graphs. Off with enforce_eager. Returns (compile seconds, capture seconds)."""
        s = self.settings
        if s.enforce_eager:
            return 0.0, 0.0
        from compiler.capture import compile_count, configure_compile_cache

        cache = configure_compile_cache(*export_compile_cache_dir(s.resolved_compile_cache_dir()))
        graphs_before = compile_count()
        compile_s = self.runner.compile_model()
        logger.info("compiled the forward in %.1fs (%d graphs, Inductor cache %s)", compile_s,
                    compile_count() - graphs_before, cache)
        capture_s = 0.0
        if self.device.type == "cuda":
            # The CUTLASS kernels read lengths on the device (one graph per bucket); the reference
            # op, which windowed models use on every backend, pads to the graph's context.
            cfg = self.model_config
            reads_lengths = self.backend.name == "cutlass" and not cfg.sliding_window and not cfg.attn_softcap
            capture_s = self.runner.capture_graphs(s.capture_sizes(), device_reads_lengths=reads_lengths)
            logger.info("captured %d decode CUDA graphs in %.1fs", len(s.capture_sizes()), capture_s)
        return compile_s, capture_s

    def _make_lora_manager(self):
        """Slots for LoRA adapters (enable_lora), with lora_modules loaded; None when off."""
        if not self.settings.enable_lora:
            return None
        from engine.lora import LoRAError, LoRAManager

        manager = LoRAManager(self.model, self.settings.max_loras, self.settings.max_lora_rank)
        for i, (name, path) in enumerate(self.settings.lora_module_map().items(), start=1):
            try:
                manager.ensure(LoRARequest(name, i, path))
            except LoRAError as exc:
                raise ValueError(f"lora_modules: {exc}") from exc
        return manager

    def _make_proposer(self) -> NgramProposer | None:
        s = self.settings
        if s.speculative_method is None:
            return None
        logger.info("speculative decoding: %s, up to %d draft tokens (lookup %d..%d tokens)", s.speculative_method,
                    s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max)
        return NgramProposer(SpecDecodeConfig(s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min))

    def _make_swap_space(self) -> SwapSpace | None:
        """The CPU block pool for preemption by swap (none in recompute mode or with no swap space)."""
        s = self.settings
        self.swap_space: SwapSpace | None = None
        self.block_swapper = None
        self._pinned_blocks: set[int] = set()  # warm-prefix blocks (each pinned once)
        if s.preemption_mode == "recompute" or s.swap_space_gb <= 0:
            return None
        cfg = self.model_config
        per_block = KVCache.bytes_per_block(cfg.num_layers, s.block_size, cfg.num_kv_heads, cfg.head_dim,
                                            self.dtype)
        num_cpu = int(s.swap_space_gb * (1 << 30) // per_block)
        if num_cpu < 1:
            logger.warning("swap_space_gb=%s holds no KV block of %d bytes: preempting by recompute only",
                           s.swap_space_gb, per_block)
            return None
        from compiler.swap import BlockSwapper

        self.block_swapper = BlockSwapper(self.kv_cache.tensor, num_cpu)
        self.swap_space = SwapSpace(self.pool, num_cpu, bytes_per_block=per_block)
        logger.info("swap space: %d CPU blocks (%.2f GiB%s), preemption mode %s", num_cpu,
                    num_cpu * per_block / (1 << 30), ", pinned" if self.device.type == "cuda" else "",
                    s.preemption_mode)
        return self.swap_space

    # ---- start-up sizing ----
    def _resolve_max_model_len(self) -> int:
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        want = self.settings.max_model_len
        if want is None:
            return limit
        if want > limit:
            raise ValueError(f"max_model_len ({want}) exceeds the model's limit of {limit} positions")
        return want

    def _token_budget(self) -> int:
        s = self.settings
        if not s.enable_chunked_prefill:
            return max(s.max_num_batched_tokens, self.max_model_len)
        return s.max_num_batched_tokens

    def _num_kv_blocks(self) -> int:
        s = self.settings
        cfg = self.model_config
        per_block = KVCache.bytes_per_block(cfg.num_layers, s.block_size, cfg.num_kv_heads, cfg.head_dim,
                                            self.dtype)
        if s.num_gpu_blocks is not None:
            return s.num_gpu_blocks + 1  # plus the null block
        if self.device.type == "cpu":
            budget = s.kv_cache_memory_gb * (1 << 30)
        else:
            budget = self._free_gpu_bytes_after_profile()
        blocks = int(budget // per_block)
        if blocks < 2:
            raise ValueError(f"the KV cache gets {budget / (1 << 20):.0f} MiB, not enough for 2 blocks of "
                             f"{per_block} bytes: raise gpu_memory_utilization or kv_cache_memory_gb")
        return blocks

    def _free_gpu_bytes_after_profile(self) -> float:
        """Memory left for KV under gpu_memory_utilization, after a forward at the largest batch."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = self._token_budget()
        cfg = self.model_config
        dummy = KVCache(cfg.num_layers, 2, self.settings.block_size, cfg.num_kv_heads, cfg.head_dim,
                        self.dtype, self.device)
        from engine.attention.base import AttentionMetadata

        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(n, 1, dtype=torch.int32, device=self.device),
            max_query_len=1, max_seq_len=1)
        with torch.inference_mode():
            hidden = self.model(ids, ids, dummy.tensor, meta)
            self.model.compute_logits(hidden[: self.settings.max_num_seqs])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del dummy, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        return total * self.settings.gpu_memory_utilization - used_by_others - peak

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
        """Queue a request. With `pooling` it is an embedding request: the prompt's hidden states
        are pooled into RequestOutput.embedding and nothing is generated (params are ignored)."""
        if pooling is not None:
            hidden = self.model_config.hidden_size
            if pooling.dimensions is not None and pooling.dimensions > hidden:
                raise InvalidRequestError(f"dimensions ({pooling.dimensions}) exceeds the model's hidden size "
                                          f"({hidden})", "dimensions")
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind="final_only")
        elif not self.model_config.generates:
            raise InvalidRequestError(f"this checkpoint ({self.model_dir.name}) has no language-model head: it "
                                      "serves embeddings only (/v1/embeddings, LLM.embed)", "model")
        params = params or SamplingParams()
        params.validate()
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
                          params=params, priority=priority)
        if params.structured_outputs is not None:
            request.grammars = self.structured_output.matchers(params.structured_outputs, params.n, ids)
        if lora_request is not None:
            self._attach_lora(request, lora_request)
        request.pooling = pooling
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

    def _attach_lora(self, request: Request, lora_request: LoRARequest) -> None:
        """Run `request` with this adapter (loaded into a free slot first if it is new)."""
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters need the engine started with enable_lora", "model")
        from engine.lora import LoRAError

        try:
            entry = self.lora.ensure(lora_request)
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), "model") from exc
        request.lora_request = lora_request
        request.lora_slot = entry.slot
        request.prefix_root = entry.prefix_root

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load a LoRA adapter into a free slot (call between steps)."""
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters need the engine started with enable_lora", "lora_name")
        from engine.lora import LoRAError

        if self.lora.get(name) is not None:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        lora_request = LoRARequest(name, max((a.lora_int_id for a in self.lora.adapters), default=0) + 1, path)
        try:
            self.lora.ensure(lora_request)
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), "lora_path") from exc
        return lora_request

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no unfinished request uses (call between steps)."""
        if self.lora is None or self.lora.get(name) is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.lora_request is not None and r.lora_request.lora_name == name and not r.is_finished]
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished requests",
                                      "lora_name")
        self.lora.unload(name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        self.scheduler.pop_finished_request(request_id)
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        if self.block_swapper is not None:
            measured = self.block_swapper.measurement()  # an earlier step's copies, if done
            if measured is not None:
                self.swap_space.observe_swap(*measured)
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            # Queued on the swap stream; the compute stream waits for them before this step's
            # copy-on-write copies and forward (no host sync: the runner's input prep overlaps).
            self.block_swapper.launch(sched.blocks_to_swap_out, sched.blocks_to_swap_in)
            self.block_swapper.wait()
        sampled = self.runner.execute(sched)
        if sampled.prompt_logprobs:
            self._record_prompt_logprobs(sampled.prompt_logprobs)
        pooled_done = self._record_pooled(sampled.pooled) if sampled.pooled else []
        tokens = self.runner.split_sampled(sched, sampled)
        failed = self._failed_rows(sched, sampled.errors)
        for i, s in enumerate(sched.seqs):
            if s.seq_id in failed:
                tokens[i] = []  # no token for a failed row: its request is failed below
        logprobs = self._split_logprobs(sched, sampled.logprobs)
        touched = self.scheduler.update(sched, tokens)
        now = time.monotonic()
        outputs: dict[str, Request] = {}
        for seq in pooled_done:  # embedding requests whose prompt is done: finished, no token
            self.scheduler.finish_seq(seq, FinishReason.STOP)
            seq.request.first_token_time = now
            outputs[seq.request.request_id] = seq.request
        generated = 0
        for seq in touched:
            try:
                generated += self._process_new_tokens(seq, logprobs)
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer fails on this output: fail only it
                logger.exception("request %s: processing its output failed", seq.request.request_id)
                failed[seq.seq_id] = f"processing the output failed: {type(exc).__name__}: {exc}"
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            if seq.finish_reason is not None:
                self.scheduler.finish_seq(seq, seq.finish_reason, seq.stop_reason)
            outputs[request.request_id] = request
        if failed:
            by_id = {s.seq_id: s for s in self.scheduler.running}
            for seq_id, message in failed.items():
                seq = by_id.get(seq_id)
                if seq is not None and not seq.request.is_finished:
                    self._fail_request(seq.request, message)
                    outputs[seq.request.request_id] = seq.request
        results = []
        for request in outputs.values():
            if request.is_finished:
                request.finished_time = now
                self.scheduler.pop_finished_request(request.request_id)
            out = self._output(request)
            if out is not None:
                results.append(out)
        self.last_step = StepStats(sched.num_prefill_tokens, generated, time.perf_counter() - t0)
        if self.swap_space is not None and sched.num_prefill_tokens >= max(MIN_PREFILL_SAMPLE,
                                                                           sched.num_decode_tokens):
            # A prefill-dominated step prices recomputation for auto preemption (SwapSpace).
            self.swap_space.observe_prefill(sched.num_tokens, self.last_step.duration)
        self.num_prompt_tokens_total += sched.num_prefill_tokens
        self.num_generation_tokens_total += generated
        return results

    def _process_new_tokens(self, seq: Sequence, logprobs: dict[int, list]) -> int:
        """Logprobs, grammar and stop checks for the tokens the step appended to seq, one token at
        a time (a speculative step appends several); tokens after the one that finishes seq are
        dropped. Returns how many tokens seq keeps."""
        count = seq.num_new_tokens
        pending = seq.token_ids[len(seq.token_ids) - count:]
        del seq.token_ids[len(seq.token_ids) - count:]
        for j, token in enumerate(pending):
            seq.token_ids.append(token)
            self._record_logprob(seq, logprobs, j)
            if seq.read_offset == 0:  # a sample forked by the scheduler: its text starts after the prompt
                init_offsets(seq)
            grammar_done = self._advance_grammar(seq)
            check_stop(self.tokenizer, seq, self.eos_token_ids, self.max_model_len)
            if grammar_done and seq.finish_reason is None:  # (a stop token kept by ignore_eos)
                seq.finish_reason = FinishReason.STOP
            if seq.finish_reason is not None:
                return j + 1
        return count

    @staticmethod
    def _advance_grammar(seq: Sequence) -> bool:
        """Feed seq's new token to its grammar matcher (structured outputs); True once the output
        is complete. The sampler only allows tokens the matcher accepts, so a refusal is a bug."""
        grammars = seq.request.grammars
        if not grammars:
            return False
        matcher = grammars[seq.sample_index]
        token = seq.token_ids[-1]
        if not matcher.accept(token):
            raise RuntimeError(f"structured output: token {token} is outside the constraint's language")
        return matcher.is_terminated

    @staticmethod
    def _failed_rows(sched: SchedulerOutput, errors: dict[int, str]) -> dict[int, str]:
        """seq id -> error, for the scheduled sequences whose sampler rows failed."""
        return {s.seq_id: errors[r] for s, rows in sample_row_ranges(sched.seqs) for r in rows if r in errors}

    def _fail_request(self, request: Request, message: str) -> None:
        """Finish every sequence of one request with FinishReason.ERROR; the others go on."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.error = message
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish_seq(seq, FinishReason.ERROR)

    def fail_all_requests(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request with an error (after an engine-loop crash): no one hangs.

        Returns their final outputs; the pools are left fully free.
        """
        results = []
        now = time.monotonic()
        for request in list(self.scheduler.requests.values()):
            if not request.is_finished:
                self._fail_request(request, message)
            request.finished_time = request.finished_time or now
            self.scheduler.pop_finished_request(request.request_id)
            results.append(self._output(request))
        return results

    # ---- prefix warm-up ----
    def warm_prefixes(self, token_id_lists: list[list[int]]) -> int:
        """Compute these prefixes' KV and pin their full blocks in the prefix cache for good.

        Call before serving, on an idle engine. Each prefix is run as a one-token request; its
        full blocks are then pinned (never evicted, shared by every request that starts with
        them). Returns the number of pinned blocks in the pool (metric: pool.num_pinned).
        """
        if not token_id_lists:
            return self.pool.num_pinned
        if not self.settings.enable_prefix_caching:
            logger.warning("warm prefixes ignored: prefix caching is off")
            return self.pool.num_pinned
        if self.has_unfinished_requests():
            raise RuntimeError("warm_prefixes() needs an idle engine (call it before serving)")
        bs = self.settings.block_size
        ids: dict[str, list[int]] = {}
        for i, prefix in enumerate(token_id_lists):
            prefix = list(prefix)
            if len(prefix) < bs:
                logger.warning("warm prefix %d has %d tokens, less than one block of %d: skipped",
                               i, len(prefix), bs)
                continue
            rid = f"warm-prefix-{i}-{uuid.uuid4().hex[:8]}"
            try:
                self.add_request(prefix, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                                        ignore_eos=True), rid)
            except InvalidRequestError as exc:
                for other in ids:
                    self.abort_request(other)
                raise ValueError(f"warm prefix {i}: {exc}") from exc
            ids[rid] = prefix
        while self.has_unfinished_requests():
            self.step()
        newly = 0
        for prefix in ids.values():
            blocks, _ = self.pool.match_prefix(prefix, len(prefix) // bs)
            for block in blocks:
                if block not in self._pinned_blocks:
                    self.pool.pin(block)
                    self._pinned_blocks.add(block)
                    newly += 1
        logger.info("warm prefixes: %d prefixes, %d blocks pinned (%d in all, %.0f%% of the KV cache)",
                    len(ids), newly, self.pool.num_pinned, 100 * self.pool.num_pinned / self.pool.num_usable)
        return self.pool.num_pinned

    def _split_logprobs(self, sched: SchedulerOutput, flat: list) -> dict[int, list]:
        """seq id -> logprob entries it sampled this step (n entries at a fork)."""
        return {s.seq_id: flat[rows.start:rows.stop] for s, rows in sample_row_ranges(sched.seqs) if rows}

    def _record_logprob(self, seq: Sequence, logprobs: dict[int, list], index: int = 0) -> None:
        """Record the logprob entry of seq's token number `index` of this step."""
        # A forked child has no entry of its own: it took entry `sample_index` of its parent's list.
        entries = logprobs.get(seq.seq_id)
        if entries is None:
            parent = seq.request.seqs[0]
            entries = logprobs.get(parent.seq_id)
            entry = entries[seq.sample_index] if entries and len(entries) > seq.sample_index else None
        else:
            entry = entries[index] if len(entries) > index else None
        if entry is None:
            return
        chosen, top = entry
        seq.cumulative_logprob += chosen
        top = dict(top)
        top[seq.token_ids[-1]] = chosen
        seq.logprobs.append(top)

    def _record_pooled(self, pooled: dict[int, tuple[torch.Tensor, int, int, bool]]) -> list[Sequence]:
        """Accumulate embedding requests' pooled hidden states; returns the sequences whose prompt
        is complete, with request.embedding set."""
        by_id = {s.seq_id: s for s in self.scheduler.running}
        done = []
        for seq_id, (vector, rows, start, final) in pooled.items():
            seq = by_id.get(seq_id)
            if seq is None:
                continue
            request = seq.request
            if request.pooling.pooling_type == "mean":
                if start == 0:  # (again, after a preemption by recompute)
                    request.pool_sum, request.pool_count = None, 0
                request.pool_sum = vector if request.pool_sum is None else request.pool_sum + vector
                request.pool_count += rows
                vector = request.pool_sum / request.pool_count
            if final:
                dims = request.pooling.dimensions
                if dims is not None:
                    vector = vector[:dims]
                if request.pooling.normalize:
                    vector = torch.nn.functional.normalize(vector, dim=0)
                request.embedding = vector.tolist()
                request.pool_sum = None
                done.append(seq)
        return done

    def _record_prompt_logprobs(self, scored: dict[int, tuple[int, list[dict[int, float]]]]) -> None:
        by_id = {s.seq_id: s for s in self.scheduler.running}
        for seq_id, (first, entries) in scored.items():
            seq = by_id.get(seq_id)
            if seq is not None:  # (a recomputed prompt scores its tokens again: same entries)
                seq.request.prompt_logprobs[first:first + len(entries)] = entries

    def _output(self, request: Request) -> RequestOutput | None:
        """The request's output for this step, as its params.output_kind asks (None: nothing to
        hand out: final_only before the end, or a delta with nothing new)."""
        params = request.params
        if params.output_kind == "final_only" and not request.is_finished:
            return None
        if request.pooling is not None:  # an embedding: one output, when it is done
            if not request.is_finished:
                return None
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [], True,
                                 request.seqs[0].num_cached_tokens if request.seqs else 0, request.error,
                                 {"arrival_time": request.arrival_time, "finished_time": request.finished_time},
                                 None, request.embedding)
        seqs = sorted(request.seqs, key=lambda s: s.sample_index)
        if params.output_kind == "delta":
            outs = [c for c in map(self._delta_choice, seqs) if c is not None]
            if not outs and not request.is_finished:
                return None  # new tokens whose text is held back: they come with their text
        else:
            outs = [self._choice(seq, 0, 0, visible_len(seq)) for seq in seqs]
        metrics = {
            "arrival_time": request.arrival_time,
            "first_scheduled_time": request.first_scheduled_time,
            "first_token_time": request.first_token_time,
            "finished_time": request.finished_time,
        }
        # prompt_logprobs: the request's own list (complete once the first token exists; not copied per step)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs,
                             request.is_finished, request.seqs[0].num_cached_tokens if request.seqs else 0,
                             request.error, metrics, request.prompt_logprobs)

    @staticmethod
    def _choice(seq: Sequence, tokens_from: int, chars_from: int, chars_to: int) -> CompletionOutput:
        """seq's output tokens from `tokens_from` on, and its text [chars_from, chars_to)."""
        logprobs = seq.request.params.logprobs is not None
        return CompletionOutput(
            index=seq.sample_index,
            text=seq.text[chars_from:chars_to],
            token_ids=seq.token_ids[seq.num_prompt_tokens + tokens_from:],
            cumulative_logprob=seq.cumulative_logprob if logprobs else None,
            logprobs=seq.logprobs[tokens_from:] if logprobs else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_preemptions=seq.num_preemptions,
        )

    def _delta_choice(self, seq: Sequence) -> CompletionOutput | None:
        """What is new in seq since its last delta, or None. New tokens whose text is still held
        back (a split UTF-8 character, a possible stop string) wait for their text, unless the
        request is not detokenised; the delta that ends a sequence comes once."""
        if seq.emitted_finish:
            return None
        chars = visible_len(seq)
        finished = seq.finish_reason is not None
        new_tokens = seq.num_output_tokens > seq.emitted_tokens
        if not (chars > seq.emitted_chars or finished or (new_tokens and not seq.request.params.detokenize)):
            return None
        out = self._choice(seq, seq.emitted_tokens, seq.emitted_chars, chars)
        seq.emitted_tokens, seq.emitted_chars, seq.emitted_finish = seq.num_output_tokens, chars, finished
        return out

    # ---- invariants ----
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def is_idle_and_free(self) -> bool:
        swap_free = self.swap_space is None or self.swap_space.is_fully_free()
        return not self.scheduler.has_unfinished() and self.pool.is_fully_free() and swap_free
