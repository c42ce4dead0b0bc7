"""EngineBuilder: everything an engine is made of, built and sized once at start-up.

Model directory, config, device and dtype; tokenizer and stop ids; weights; attention
backend; the KV cache sized from memory (a profile forward on a GPU); block pool, swap space,
speculative proposer, scheduler, sampler and runner; then compilation and CUDA-graph capture.
Each phase is logged with the time it took, so a cold start says what it is doing. The tokenizer
loads on a thread beside the weights. Speculative decoding's parts are made in builder_draft.py, the
CPU's weight finishing and warm-up in builder_cpu.py, the KV scales and swap space in builder_kv.py.
`build()` returns the parts (`EngineParts`); LLMEngine.from_settings (engine/runtime/llm_engine.py)
hands them to an EngineCore and its front as constructor arguments.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from compiler.kernels.cpu_gemv import GEMV
from engine.config.generation_config import GenerationDefaults, load_generation_defaults, with_overrides
from engine.config.process_env import export_compile_cache_dir
from engine.config.settings import EngineSettings
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from engine.layers.attention.selector import attention_backend_for
from engine.layers.kv_cache import KVCache, resolve_kv_cache_dtype
from engine.layers.quant.cpu_packed import activations_choice, has_packed_layers
from engine.layers.quant.w4a16 import install as install_w4a16
from engine.layers.quant.w4a16 import loader_int4_kernel, resolve_int4_kernel
from engine.lora.adapters import LoRAManager, make_lora_manager
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader.model_loader import load_model, load_tokenizer
from engine.resolve.build_target import resolve_device, resolve_dtype, resolve_model_dir
from engine.runtime import builder_cpu, builder_draft, builder_kv
from engine.runtime import builder_cpu_crossover as cpu_crossover
from engine.runtime.kv_tiers import KVTiers
from engine.runtime.kv_tiers_setup import build_kv_tiers
from engine.runtime.startup_phase import Phase
from engine.structured_output.grammars import StructuredOutputCompiler
from engine.worker import kv_sizing
from engine.worker.cpu_isa import apply_cpu_isa_limit
from engine.worker.cpu_threads import ThreadPlan, apply_cpu_threads
from engine.worker.model_runner import ModelRunner
from engine.worker.sample.sampler import Sampler

if TYPE_CHECKING:
    from engine.executor.tp_executor import MirroredSwapper
    from engine.worker.block_swapper import BlockSwapper, SwapGroup

logger = logging.getLogger(__name__)


def _in_background(fn: Callable[[], Any], name: str) -> Future:
    """fn() on its own thread; the future holds its result or its exception."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)  # (the thread ends when fn returns)


@dataclass(frozen=True)
class EngineParts:
    """What the builder made, each part once: the front's (LLMEngine: admission and start-up facts)
    and the core's (EngineCore: scheduler, runner, pools, the model side)."""

    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    generation_defaults: GenerationDefaults
    structured_output: StructuredOutputCompiler
    model: LlamaForCausalLM  # (a ShardedModel with tensor parallelism)
    lora: LoRAManager | None
    backend: Any  # the attention backend (engine/layers/attention/)
    kv_cache: KVCache
    num_blocks: int  # (the null block included)
    pool: BlockPool
    swap_space: SwapSpace | None
    block_swapper: BlockSwapper | SwapGroup | MirroredSwapper | None
    kv_tiers: KVTiers | None
    scheduler: Scheduler
    runner: ModelRunner  # (a TensorParallelRunner with tensor parallelism)
    draft_runner: ModelRunner | None
    executor: Any  # engine/executor/tp_executor.py TensorParallelExecutor, or None
    async_scheduling: bool
    cpu_threads: ThreadPlan
    compile_seconds: float
    capture_seconds: float


class EngineBuilder:
    """Builds every part of an engine from settings; `build()` runs the phases and returns them
    (`EngineParts`)."""

    block_swapper: BlockSwapper | SwapGroup | MirroredSwapper | None  # (engine/runtime/builder_kv.py)

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings

    def build(self) -> EngineParts:
        try:
            self._build()
            return EngineParts(**{f.name: getattr(self, f.name) for f in fields(EngineParts)})
        except BaseException:
            executor = getattr(self, "executor", None)
            if executor is not None:  # no worker outlives a failed start
                executor.shutdown()
            raise

    def _build(self) -> None:
        settings = self.settings
        self.model_dir = resolve_model_dir(settings.model, settings.cache_dir)
        self.model_config = cfg = ModelConfig.from_dir(self.model_dir, settings.cache_dir)
        self.device = resolve_device(settings.device)
        self.cpu_threads = apply_cpu_threads(self._cpu_threads(), settings.cpu_bind)
        if self.device.type == "cpu":
            apply_cpu_isa_limit()  # (before the weights load: the decoder stack takes its kernel level)
            GEMV.configure(settings.resolved_compile_cache_dir())  # (kiln's compile cache, not a temp dir)
        self.library_builds = builder_cpu.library_builds()
        self.dtype = resolve_dtype(settings.dtype, self.model_config, self.device, self.model_dir)
        self.kv_dtype = resolve_kv_cache_dtype(
            settings.kv_cache_dtype, self.dtype, self.device.type, settings.tensor_parallel_size
        )
        self.max_model_len = self._resolve_max_model_len()
        self.async_scheduling = settings.resolved_async_scheduling(self.device.type)
        # The tokenizer loads on a thread while the weights load (transformers' import and the
        # tokenizer's files: about a second of a warm start, issue 40); joined before its first use.
        tokenizer = _in_background(self._read_tokenizer, "kiln-tokenizer")
        torch.manual_seed(settings.seed)
        if settings.enable_lora and cfg.is_moe:
            raise ValueError("enable_lora: LoRA adapters are not supported for mixture-of-experts models")
        self.executor = None  # tensor parallelism: the workers (engine/executor/tp_executor.py)
        if settings.tensor_parallel_size > 1:
            from engine.executor.tp_executor import TensorParallelExecutor

            self.executor = TensorParallelExecutor.start(
                settings, self.model_dir, self.device, self.dtype, self.max_model_len
            )
        huge_pages = self.device.type == "cpu" and settings.cpu_huge_pages and self.executor is None
        int4_kernel = resolve_int4_kernel(settings.int4_kernel, self.device, settings.resolved_kernel_cache_dir())
        with Phase(
            f"loading weights of {self.model_dir} ({cfg.model_type}, "
            f"{str(self.dtype).removeprefix('torch.')}) onto {self.device}"
        ):
            self.model = load_model(
                self.model_dir,
                cfg,
                self.dtype,
                self.device,
                self.max_model_len,
                settings.load_format,
                settings.seed,
                lora=(settings.max_loras, settings.max_lora_rank) if settings.enable_lora else None,
                quantization=settings.quantization,
                int4_kernel=loader_int4_kernel(int4_kernel),
                gguf_dequantize=settings.gguf_dequantize,
                tp=self._model_tp(),
                quant_activations=settings.cpu_quant_activations,
                on_allocated=builder_cpu.huge_page_advice() if huge_pages else None,
            )
            if self.device.type == "cpu" and has_packed_layers(self.model):
                logger.info(
                    "quantised layers on the CPU kernels: %s",
                    activations_choice(self.dtype, settings.cpu_quant_activations)[1],
                )
                crossover = cpu_crossover.resolve(settings.cpu_quant_gemm_rows, settings.cache_dir)
                logger.info(crossover.summary(cpu_crossover.apply(self.model, crossover, self.dtype)))
            if int4_kernel == "kiln":  # int4 layers -> kiln's W4A16 GEMM layout
                install_w4a16(self.model, settings.resolved_kernel_cache_dir(), self.device, self.dtype)
        self.lora = make_lora_manager(self.model, settings)
        self.backend = attention_backend_for(
            settings, cfg, self.device, self.dtype, self.kv_dtype if self.kv_dtype != self.dtype else None
        )
        self.model.set_backend(self.backend)
        if self.executor is not None:
            # (ShardedModel stands in for the model: what it does not override goes to the shard)
            self.model = cast(LlamaForCausalLM, self.executor.wrap_model(self.model))
        self._finish_tokenizer(tokenizer)
        # speculative decoding's draft model or EAGLE head, if any
        self.draft = builder_draft.load_draft(
            settings, self.model, cfg, len(self.tokenizer), self.dtype, self.device, self.max_model_len
        )
        with Phase("sizing the KV cache" + (" (profiling a forward)" if self.device.type == "cuda" else "")):
            self.num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCache(
            cfg.num_layers,
            self.num_blocks,
            settings.block_size,
            self._kv_heads(),
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            model_dtype=self.dtype,
        )
        builder_kv.set_kv_scales(settings, self.kv_cache, self.backend, self.model_dir, cfg.num_layers, self.num_blocks)
        self.draft_kv = (
            None
            if self.draft is None
            else KVCache(  # the draft's KV: the same block ids
                self.draft.config.num_layers,
                self.num_blocks,
                settings.block_size,
                self.draft.config.num_kv_heads,
                self.draft.config.head_dim,
                self.dtype,
                self.device,
            )
        )
        if self.device.type == "cpu" and self.executor is None:
            builder_cpu.finish_weights(
                settings,
                self.model,
                self.dtype,
                [self.draft.model] if self.draft is not None else [],
                huge_pages=settings.cpu_huge_pages,
            )
        self.pool = BlockPool(self.num_blocks, settings.block_size, settings.enable_prefix_caching)
        max_tokens_per_seq = self.pool.num_usable * settings.block_size
        if self.max_model_len > max_tokens_per_seq:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache can hold "
                f"({max_tokens_per_seq} tokens in {self.pool.num_usable} blocks of {settings.block_size}); "
                "lower max_model_len or give the cache more memory (num_gpu_blocks, "
                "gpu_memory_utilization, kv_cache_memory_gb)"
            )
        self.swap_space, self.block_swapper = builder_kv.make_swap_space(
            settings,
            self.pool,
            [self.kv_cache] + ([self.draft_kv] if self.draft_kv is not None else []),
            self._bytes_per_block(),
            pinned=self.device.type == "cuda",
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=self._token_budget(),
                max_model_len=self.max_model_len,
                block_size=settings.block_size,
                enable_chunked_prefill=settings.enable_chunked_prefill,
                preemption_mode=settings.preemption_mode,
                reserved_blocks_fraction=settings.reserved_blocks_fraction,
                reserved_priority=settings.reserved_priority,
                eos_token_ids=self.eos_token_ids,
                # (CPU only: on a GPU, new prefill chunk sizes would be new step shapes to compile)
                target_itl_ms=settings.target_itl_ms if self.device.type == "cpu" else None,
                long_prefill_token_threshold=settings.long_prefill_token_threshold,
                whole_prompts_first=settings.whole_prompts_first,
                micro_batch_tokens=settings.cpu_micro_batch_tokens if self.device.type == "cpu" else 0,
                prefill_wave_tokens=settings.cpu_prefill_wave_tokens if self.device.type == "cpu" else 0,
            ),
            self.pool,
            self.swap_space,
            builder_draft.make_spec_decoder(settings, self.max_model_len),
        )
        self.kv_tiers = build_kv_tiers(
            settings,
            self.model_dir,
            self.kv_cache.tensor,
            self.kv_cache.scales,
            self.dtype,
            self.device,
            self.pool,
            self.scheduler,
        )
        self.sampler = Sampler(self.device, self.eos_token_ids, settings.seed)
        runner_cls = ModelRunner
        if self.executor is not None:
            from engine.executor.tp_executor import TensorParallelRunner

            runner_cls = TensorParallelRunner
            self.executor.send_layout(self.num_blocks, self.swap_space.num_blocks if self.swap_space else 0)
            self.block_swapper = self.executor.wrap_swapper(self.block_swapper)
        self.runner = runner_cls(
            self.model,
            self.kv_cache,
            self.sampler,
            self.device,
            settings.block_size,
            settings.max_num_seqs,
            self._token_budget(),
            self.max_model_len,
        )
        self.runner.executor = self.executor
        self.draft_runner = None
        if self.draft is not None:
            assert self.draft_kv is not None  # (made with the draft)
            self.draft_runner = builder_draft.make_device_proposer(
                settings,
                self.draft,
                self.draft_kv,
                self.model,
                self.runner,
                cfg,
                self.sampler,
                self.dtype,
                self.device,
                self._token_budget(),
                self.max_model_len,
            )
        self.compile_seconds, self.capture_seconds = self._compile_and_capture()

    def _read_tokenizer(self) -> Any:
        with Phase("loading the tokenizer"):
            return load_tokenizer(self.settings.tokenizer or self.model_dir, self.settings.cache_dir)

    def _finish_tokenizer(self, loading: Future) -> None:
        """The tokenizer (waited for), its chat template, the stop ids, structured outputs."""
        settings = self.settings
        self.tokenizer = loading.result()
        template = settings.resolved_chat_template()
        if template is not None:
            self.tokenizer.chat_template = template
        eos = set(self.model_config.eos_token_ids)
        self.generation_defaults = with_overrides(
            load_generation_defaults(self.model_dir, settings.generation_config), settings.override_generation_config
        )
        eos.update(self.generation_defaults.eos_token_ids)  # stop tokens listed only in generation_config
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.structured_output = StructuredOutputCompiler(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )

    def _compile_and_capture(self) -> tuple[float, float]:
        """torch.compile the forward (persistent Inductor cache) and, on a GPU, capture the decode
        CUDA graphs. Off with enforce_eager. Returns (compile seconds, capture seconds)."""
        s = self.settings
        runners = [self.runner] + ([self.draft_runner] if self.draft_runner is not None else [])
        if self.device.type == "cpu":
            builder_cpu.warm_cpu_linear(s, runners)
        if s.enforce_eager:
            return 0.0, 0.0
        if self.executor is not None and self.device.type == "cuda":
            # Rank 0's compiled forward would have to hold the step broadcast (a graph break).
            logger.warning(
                "tensor_parallel_size %d: the forward runs eagerly on every rank (no torch.compile, "
                "no CUDA graphs across ranks yet)",
                s.tensor_parallel_size,
            )
            return 0.0, 0.0
        if self.device.type == "cpu":  # what pays on the CPU: engine/worker/cpu_warmup.py
            seconds = builder_cpu.warm_cpu_kernels(s, runners)
            if not s.cpu_compile_forward:
                logger.info(
                    "CPU: eager forward, C++ paged attention; warm-up %.1fs%s",
                    seconds,
                    builder_cpu.compiled_since(self.library_builds),
                )
                return seconds, 0.0
        from compiler.compilation.capture import compile_count, configure_compile_cache

        cache = configure_compile_cache(*export_compile_cache_dir(s.resolved_compile_cache_dir()))
        graphs_before = compile_count()
        with Phase(f"compiling the forward (slow on the first start only; cached in {cache})"):
            compile_s = sum(runner.compile_model() for runner in runners)
        logger.info("compiled %d graphs", compile_count() - graphs_before)
        capture_s = 0.0
        if self.device.type == "cuda":
            # The CUTLASS kernels read lengths on the device (one graph per bucket); the reference
            # op, which windowed models use on every backend, pads to the graph's context.
            cfg = self.model_config
            reads_lengths = self.backend.name == "cutlass" and not cfg.sliding_window and not cfg.attn_softcap
            sizes = s.capture_sizes()
            with Phase(
                f"capturing {len(sizes)} decode CUDA graphs (batch sizes {sizes[0]}..{sizes[-1]})"
                if sizes
                else "capturing no decode CUDA graphs"
            ):
                capture_s = sum(
                    runner.capture_graphs(
                        sizes,
                        device_reads_lengths=reads_lengths,
                        max_query=builder_draft.verify_query(s, runner is self.draft_runner),
                    )
                    for runner in runners
                )
        return compile_s, capture_s

    # ---- tensor parallelism ----
    def _cpu_threads(self) -> int | None:
        if self.settings.tensor_parallel_size > 1 and self.device.type == "cpu":
            from engine.executor.tp_executor import per_rank_cpu_threads

            return per_rank_cpu_threads(self.settings, self.settings.tensor_parallel_size)
        return self.settings.cpu_threads

    def _model_tp(self):
        return self.executor.tp if self.executor is not None else None

    def _kv_heads(self) -> int:
        """KV heads of this rank's cache (all of them without tensor parallelism)."""
        if self.executor is None:
            return self.model_config.num_kv_heads
        from engine.models.sharding import kv_heads_of

        return kv_heads_of(self.model_config, self.executor.tp)

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
        budget = builder_cpu.step_token_budget(s) if self.device.type == "cpu" else s.max_num_batched_tokens
        if not s.enable_chunked_prefill:
            return max(budget, self.max_model_len)
        return budget

    def _num_kv_blocks(self) -> int:
        s = self.settings
        per_block = self._bytes_per_block()
        if s.num_gpu_blocks is not None:
            blocks = s.num_gpu_blocks + 1  # plus the null block
        elif self.device.type == "cpu":
            blocks = kv_sizing.blocks_from_budget(
                kv_sizing.cpu_kv_bytes(
                    s, self.model_config, per_block, self.max_model_len, self._token_budget(), self.dtype
                ),
                per_block,
                "cpu",
            )
        else:
            blocks = kv_sizing.blocks_from_budget(self._free_gpu_bytes_after_profile(), per_block, "cuda")
        # No max_model_len given and the full context does not fit: serve the largest that does.
        self.max_model_len = kv_sizing.fit_max_model_len(
            s.max_model_len,
            self.max_model_len,
            blocks,
            s.block_size,
            per_block,
            self.device.type,
            s.num_gpu_blocks is not None,
        )
        return blocks

    def _bytes_per_block(self) -> int:
        """One block of every layer's K and V: the target's (an fp8 cache holds twice the blocks of
        bf16, four times fp32's) plus the draft's, which shares the block ids."""
        s, cfg = self.settings, self.model_config
        per_block = KVCache.bytes_per_block(cfg.num_layers, s.block_size, self._kv_heads(), cfg.head_dim, self.kv_dtype)
        if self.draft is not None:
            d = self.draft.config
            per_block += KVCache.bytes_per_block(d.num_layers, s.block_size, d.num_kv_heads, d.head_dim, self.dtype)
        return per_block

    def _free_gpu_bytes_after_profile(self) -> float:
        """Memory left for KV under gpu_memory_utilization, after a forward at the largest batch."""
        cfg = self.model_config
        dummy = KVCache(
            cfg.num_layers,
            2,
            self.settings.block_size,
            self._kv_heads(),
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            model_dtype=self.dtype,
        )
        return kv_sizing.free_gpu_bytes_after_profile(
            self.model,
            dummy.tensor,
            self._token_budget(),
            self.settings.max_num_seqs,
            self.settings.gpu_memory_utilization,
            self.device,
        )
