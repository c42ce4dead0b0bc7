"""EngineBuilder: everything an engine is made of, built and sized once at start-up.

Model directory, config, device and dtype; tokenizer and stop ids; weights; attention
backend; the KV cache sized from memory (a profile forward on a GPU); block pool, swap space,
speculative proposer, scheduler, sampler and runner; then compilation and CUDA-graph capture.
Each phase is logged with the time it took, so a cold start says what it is doing.
`build()` returns the parts (`EngineParts`); LLMEngine.from_settings (engine/runtime/llm_engine.py)
hands them to an EngineCore and its front as constructor arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.config.generation_config import GenerationDefaults, load_generation_defaults, with_overrides
from engine.config.process_env import export_compile_cache_dir
from engine.config.settings import EngineSettings
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from engine.layers.attention.base import BackendSpec
from engine.layers.attention.selector import get_attention_backend
from engine.layers.kv_cache import KVCache, KVScales, resolve_kv_cache_dtype
from engine.layers.quant.cpu_packed import activations_choice, has_packed_layers
from engine.layers.quant.w4a16 import install as install_w4a16
from engine.layers.quant.w4a16 import loader_int4_kernel, resolve_int4_kernel
from engine.lora.adapters import LoRAManager, make_lora_manager
from engine.models.config import ModelConfig
from engine.models.draft import DraftParts, check_draft_model, load_draft_vocab
from engine.models.eagle import Eagle3Head, EagleConfig, EagleHead, load_eagle
from engine.models.llama import LlamaForCausalLM
from engine.models.loader.gguf_file import is_gguf
from engine.models.loader.kv_scales import read_kv_scales
from engine.models.loader.model_loader import load_model, load_tokenizer
from engine.resolve.build_target import resolve_device, resolve_dtype, resolve_model_dir
from engine.runtime.kv_tiers import KVTiers
from engine.runtime.kv_tiers_setup import build_kv_tiers
from engine.runtime.startup_phase import Phase
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.sched import DraftLengthPlanner, NgramProposer, SpecDecodeConfig, SpecDecoder
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

    block_swapper: BlockSwapper | SwapGroup | MirroredSwapper | None  # (set by _make_swap_space)

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings

    def build(self) -> EngineParts:
        try:
            self._build()
            return EngineParts(
                model_dir=self.model_dir,
                model_config=self.model_config,
                device=self.device,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                tokenizer=self.tokenizer,
                eos_token_ids=self.eos_token_ids,
                generation_defaults=self.generation_defaults,
                structured_output=self.structured_output,
                model=self.model,
                lora=self.lora,
                backend=self.backend,
                kv_cache=self.kv_cache,
                num_blocks=self.num_blocks,
                pool=self.pool,
                swap_space=self.swap_space,
                block_swapper=self.block_swapper,
                kv_tiers=self.kv_tiers,
                scheduler=self.scheduler,
                runner=self.runner,
                draft_runner=self.draft_runner,
                executor=self.executor,
                async_scheduling=self.async_scheduling,
                cpu_threads=self.cpu_threads,
                compile_seconds=self.compile_seconds,
                capture_seconds=self.capture_seconds,
            )
        except BaseException:
            executor = getattr(self, "executor", None)
            if executor is not None:  # no worker outlives a failed start
                executor.shutdown()
            raise

    def _build(self) -> None:
        settings = self.settings
        self.model_dir = resolve_model_dir(settings.model, settings.cache_dir)
        self.model_config = cfg = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(settings.device)
        self.cpu_threads = apply_cpu_threads(self._cpu_threads(), settings.cpu_bind)
        if self.device.type == "cpu":
            apply_cpu_isa_limit()  # (before the weights load: the decoder stack takes its kernel level)
        self.dtype = resolve_dtype(settings.dtype, self.model_config, self.device, self.model_dir)
        self.kv_dtype = resolve_kv_cache_dtype(
            settings.kv_cache_dtype, self.dtype, self.device.type, settings.tensor_parallel_size
        )
        self.max_model_len = self._resolve_max_model_len()
        self.async_scheduling = settings.resolved_async_scheduling(self.device.type)
        with Phase("loading the tokenizer"):
            self._load_tokenizer()
        torch.manual_seed(settings.seed)
        if settings.enable_lora and cfg.is_moe:
            raise ValueError("enable_lora: LoRA adapters are not supported for mixture-of-experts models")
        self.executor = None  # tensor parallelism: the workers (engine/executor/tp_executor.py)
        if settings.tensor_parallel_size > 1:
            from engine.executor.tp_executor import TensorParallelExecutor

            self.executor = TensorParallelExecutor.start(
                settings, self.model_dir, self.device, self.dtype, self.max_model_len
            )
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
                on_allocated=self._advise_huge_pages if self._huge_pages() else None,
            )
            if self.device.type == "cpu" and has_packed_layers(self.model):
                logger.info(
                    "quantised layers on the CPU kernels: %s",
                    activations_choice(self.dtype, settings.cpu_quant_activations)[1],
                )
            if int4_kernel == "kiln":  # int4 layers -> kiln's W4A16 GEMM layout
                install_w4a16(self.model, settings.resolved_kernel_cache_dir(), self.device, self.dtype)
        self.lora = make_lora_manager(self.model, settings)
        self.backend = get_attention_backend(
            settings.attention_backend,
            BackendSpec(
                device=self.device,
                dtype=self.dtype,
                head_dim=cfg.head_dim,
                block_size=settings.block_size,
                kernel_cache_dir=settings.resolved_kernel_cache_dir(),
                compile=not settings.enforce_eager,
                decode_kernel=settings.decode_kernel,
                prefill_kernel=settings.prefill_kernel,
                windowed_or_capped=any(self.model_config.layer_windows) or self.model_config.attn_softcap > 0,
                kv_cache_dtype=self.kv_dtype if self.kv_dtype != self.dtype else None,
            ),
        )
        self.model.set_backend(self.backend)
        if self.executor is not None:
            # (ShardedModel stands in for the model: what it does not override goes to the shard)
            self.model = cast(LlamaForCausalLM, self.executor.wrap_model(self.model))
        self.draft = self._load_draft()  # speculative decoding's draft model or EAGLE head, if any
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
        self._set_kv_scales()
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
        if self.device.type == "cpu" and settings.cpu_half_weights and self.executor is None:
            # (the layers' post-load hook: engine/layers/linear.py)
            changed, saved, head_saved = self.model.process_weights_after_loading(self.dtype, "half")
            if changed:
                logger.info(
                    "%d float32 projection weights hold only 2-byte values: kept in 2 bytes (%.0f MB less "
                    "per decode step; cpu_half_weights)",
                    changed,
                    saved / 1e6,
                )
            if head_saved:
                logger.info(
                    "the LM head holds only 2-byte values: decode steps read a 2-byte copy (%.0f MB less "
                    "per step, as much more in memory; cpu_half_weights)",
                    head_saved / 1e6,
                )
        if self.device.type == "cpu" and self.executor is None:
            self._keep_gemm_weights(settings.cpu_gemm_packed_weights)
        if self._huge_pages():
            from engine.worker.cpu_huge_pages import back_with_huge_pages

            # (the weights only: collapsing a KV cache copies all of it at every start, for little)
            models = [self.model] + ([self.draft.model] if self.draft is not None else [])
            back_with_huge_pages([t for m in models for t in (*m.parameters(), *m.buffers())], "weights")
        self.pool = BlockPool(self.num_blocks, settings.block_size, settings.enable_prefix_caching)
        max_tokens_per_seq = self.pool.num_usable * settings.block_size
        if self.max_model_len > max_tokens_per_seq:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache can hold "
                f"({max_tokens_per_seq} tokens in {self.pool.num_usable} blocks of {settings.block_size}); "
                "lower max_model_len or give the cache more memory (num_gpu_blocks, "
                "gpu_memory_utilization, kv_cache_memory_gb)"
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
            ),
            self.pool,
            self._make_swap_space(),
            self._make_spec_decoder(),
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
        self.draft_runner = self._make_device_proposer()
        self.compile_seconds, self.capture_seconds = self._compile_and_capture()

    def _huge_pages(self) -> bool:
        return self.device.type == "cpu" and self.settings.cpu_huge_pages and self.executor is None

    @staticmethod
    def _advise_huge_pages(model: torch.nn.Module) -> None:
        """Before the weights are written: their pages fault in as huge pages (no collapse copy later)."""
        from engine.worker.cpu_huge_pages import advise_huge_pages

        advise_huge_pages([*model.parameters(), *model.buffers()])

    def _keep_gemm_weights(self, setting: str) -> None:
        """oneDNN's blocked weight copies for GEMM rows, where cpu_gemm_packed_weights says so
        (engine/worker/cpu_gemm_weights.py; made by the layers' hook); the choice and why, logged."""
        from engine.worker import cpu_gemm_weights as gw

        wanted = gw.dense_weight_bytes(self.model, self.dtype)
        free = kv_sizing.read_free_memory()  # (MemAvailable, or less under a cgroup limit)
        keep, why = gw.gemm_weights_choice(setting, self.dtype, wanted, gw.has_amx(), free.bytes if free else 0)
        if not keep:
            logger.info("oneDNN weight copies for GEMM rows: off (%s)", why)
            return
        with Phase("packing oneDNN weight copies for GEMM rows"):
            made, nbytes, head_bytes = self.model.process_weights_after_loading(self.dtype, "gemm")
        made, nbytes = made + (head_bytes > 0), nbytes + head_bytes
        logger.info(
            "oneDNN weight copies for GEMM rows: %d weights, %.0f MB more in memory (%s)", made, nbytes / 1e6, why
        )

    def _load_tokenizer(self) -> None:
        settings = self.settings
        self.tokenizer = load_tokenizer(settings.tokenizer or self.model_dir)
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
            for runner in runners:
                warm = getattr(runner.model, "warm_cpu_linear", None)
                if warm is not None:  # oneDNN's shapes, built now
                    warm(s.max_num_batched_tokens, s.max_num_seqs)
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
            from engine.worker.cpu_warmup import warm_cpu_decode

            seconds = 0.0
            for runner in runners:
                fuse = getattr(runner.model, "use_cpu_fused_ops", None)
                if fuse is not None:  # fused norms / RoPE / SiLU (compiler/kernels/cpu_fused.py)
                    fuse(s.resolved_compile_cache_dir())
                seconds += warm_cpu_decode(
                    runner.model, runner.kv_cache.tensor, s.resolved_compile_cache_dir(), s.cpu_decoder_stack
                )
            if not s.cpu_compile_forward:
                logger.info("CPU: eager forward, C++ paged attention; warm-up %.1fs", seconds)
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
                        sizes, device_reads_lengths=reads_lengths, max_query=self._verify_query(runner)
                    )
                    for runner in runners
                )
        return compile_s, capture_s

    def _verify_query(self, runner: ModelRunner) -> int:
        """Tokens per sequence of the verify steps a runner replays as graphs: the target's and an
        EAGLE head's catch-up (1 + the most drafts); a draft model's forwards are decode steps."""
        s = self.settings
        if s.speculative_method is None or (runner is self.draft_runner and s.speculative_method == "draft_model"):
            return 1
        return 1 + s.num_speculative_tokens

    def _set_kv_scales(self) -> None:
        """An fp8 cache's K/V scales: calibrated on the first prompt (calculate_kv_scales), else the
        checkpoint's k_scale / v_scale, else 1.0; handed to the attention backend."""
        s, cache = self.settings, self.kv_cache
        if cache.scales is None:
            if s.calculate_kv_scales:
                logger.warning("calculate_kv_scales applies to an fp8 KV cache only (kv_cache_dtype=fp8): ignored")
            return
        from engine.models.loader.model_loader import safetensors_files

        found = None
        if self.model_dir.is_dir() and s.load_format != "dummy" and any(self.model_dir.glob("*.safetensors")):
            found = read_kv_scales(safetensors_files(self.model_dir), self.model_config.num_layers)
        if found is not None:
            cache.set_scales(found)
        source = (
            "calibrated on the first prompt (calculate_kv_scales)"
            if s.calculate_kv_scales
            else "from the checkpoint"
            if found is not None
            else "1.0 (the checkpoint has none)"
        )
        logger.info("KV cache: fp8 e4m3, %d blocks, K/V scales %s", self.num_blocks, source)
        self.backend.use_kv_scales(KVScales(cache.scales, calibrate=s.calculate_kv_scales))

    def _make_spec_decoder(self) -> SpecDecoder | None:
        """The scheduler's side of speculative decoding: n-gram drafts, or how many drafts the
        device proposer makes for each sequence, limited and accepted by a SpecDecoder."""
        s = self.settings
        if s.speculative_method is None:
            return None
        config = SpecDecodeConfig(
            s.num_speculative_tokens, s.speculative_method, s.prompt_lookup_max, s.prompt_lookup_min
        )
        proposer: NgramProposer | DraftLengthPlanner
        if not config.device_drafts:
            logger.info(
                "speculative decoding: ngram, up to %d draft tokens (lookup %d..%d tokens)",
                s.num_speculative_tokens,
                s.prompt_lookup_min,
                s.prompt_lookup_max,
            )
            proposer = NgramProposer(config)
        else:
            logger.info(
                "speculative decoding: %s %s, up to %d draft tokens per step",
                s.speculative_method,
                s.speculative_model,
                s.num_speculative_tokens,
            )
            proposer = DraftLengthPlanner(config)
        return SpecDecoder(proposer, self.max_model_len)

    # ---- speculative decoding's draft (a draft model or an EAGLE head) ----
    def _load_draft(self) -> "DraftParts | None":
        """The draft model (or EAGLE head) with its own attention backend; its KV cache is made
        with the target's once the pool is sized (the same block ids index both)."""
        s = self.settings
        if s.speculative_method not in ("draft_model", "eagle", "eagle3"):
            return None
        assert s.speculative_model is not None  # (the settings require one for these methods)
        path = Path(s.speculative_model).expanduser()
        if not path.is_dir() and not (s.speculative_method == "draft_model" and is_gguf(path)):
            raise ValueError(
                f"speculative_model: {s.speculative_model!r} is not a checkpoint directory"
                + (" or .gguf file" if s.speculative_method == "draft_model" else "")
            )
        vocab_ids = None
        model: LlamaForCausalLM | EagleHead | Eagle3Head
        config: ModelConfig | EagleConfig
        with Phase(f"loading the {s.speculative_method} draft {path}"):
            if s.speculative_method == "draft_model":
                config = layers = ModelConfig.from_dir(path)
                check_draft_model(config, self.model_config, len(self.tokenizer), path)
                model = load_model(
                    path,
                    config,
                    self.dtype,
                    self.device,
                    self.max_model_len,
                    s.load_format,
                    s.seed,
                    quant_activations=s.cpu_quant_activations,
                )
                vocab_ids = load_draft_vocab(path, config, self.model_config.vocab_size)
            else:
                model = load_eagle(
                    path,
                    3 if s.speculative_method == "eagle3" else 1,
                    self.model,
                    self.dtype,
                    self.device,
                    self.max_model_len,
                )
                config, layers = model.eagle, model.eagle.layer
        backend = get_attention_backend(
            s.attention_backend,
            BackendSpec(
                device=self.device,
                dtype=self.dtype,
                head_dim=config.head_dim,
                block_size=s.block_size,
                kernel_cache_dir=s.resolved_kernel_cache_dir(),
                compile=not s.enforce_eager,
                decode_kernel=s.decode_kernel,
                prefill_kernel=s.prefill_kernel,
                windowed_or_capped=any(layers.layer_windows) or layers.attn_softcap > 0,
            ),
        )
        model.set_backend(backend)
        return DraftParts(model, config, backend, vocab_ids)

    def _make_device_proposer(self) -> ModelRunner | None:
        """The draft's runner (its own input buffers, cache tensor and graphs) and the proposer that
        drives it inside the target runner's launch; the target's block copies cover its cache."""
        if self.draft is None:
            return None
        assert self.draft_kv is not None  # (made with the draft)
        s = self.settings
        runner = ModelRunner(
            self.draft.model,
            self.draft_kv,
            self.sampler,
            self.device,
            s.block_size,
            s.max_num_seqs,
            self._token_budget(),
            self.max_model_len,
        )
        runner.builder.shifts_from = self.runner.builder  # (a verify step in flight moves its positions too)
        if s.speculative_method == "draft_model":
            self.runner.spec = DraftModelProposer(
                runner, self.model_config.vocab_size, self.sampler.generator, self.draft.vocab_ids
            )
        else:
            head = self.draft.model
            assert isinstance(head, (EagleHead, Eagle3Head))  # (an EAGLE method's draft is its head)
            head.allocate_inputs(runner.buffers.max_tokens)
            if head.eagle.version == 3:  # the target keeps the hidden states entering the head's layers
                self.model.aux_layers = head.eagle.aux_layers
                self.model.aux_hidden = torch.zeros(
                    self.runner.buffers.max_tokens,
                    len(head.eagle.aux_layers) * self.model_config.hidden_size,
                    dtype=self.dtype,
                    device=self.device,
                )
            self.runner.spec = EagleProposer(runner, self.runner, self.sampler.generator)
        self.runner.block_copy_caches.append(self.draft_kv.tensor)
        return runner

    def _make_swap_space(self) -> SwapSpace | None:
        """The CPU block pool for preemption by swap (none in recompute mode or with no swap space)."""
        s = self.settings
        self.swap_space: SwapSpace | None = None
        self.block_swapper = None
        if s.preemption_mode == "recompute" or s.swap_space_gb <= 0:
            return None
        per_block = self._bytes_per_block()
        num_cpu = int(s.swap_space_gb * (1 << 30) // per_block)
        if num_cpu < 1:
            logger.warning(
                "swap_space_gb=%s holds no KV block of %d bytes: preempting by recompute only",
                s.swap_space_gb,
                per_block,
            )
            return None
        from engine.worker.block_swapper import BlockSwapper, SwapGroup

        self.block_swapper = BlockSwapper(self.kv_cache.tensor, num_cpu)
        if self.draft_kv is not None:  # the draft's KV moves with the target's, block for block
            self.block_swapper = SwapGroup([self.block_swapper, BlockSwapper(self.draft_kv.tensor, num_cpu)])
        self.swap_space = SwapSpace(self.pool, num_cpu, bytes_per_block=per_block)
        logger.info(
            "swap space: %d CPU blocks (%.2f GiB%s), preemption mode %s",
            num_cpu,
            num_cpu * per_block / (1 << 30),
            ", pinned" if self.device.type == "cuda" else "",
            s.preemption_mode,
        )
        return self.swap_space

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
        if not s.enable_chunked_prefill:
            return max(s.max_num_batched_tokens, self.max_model_len)
        return s.max_num_batched_tokens

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
