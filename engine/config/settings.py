"""EngineSettings, the engine's settings, and SETTING_NAMES, every setting's name (the engine's
and the server's, engine/config/server_settings.py): together the one place where kiln's settings
are defined.

Sources, lowest to highest priority: defaults, `kiln.toml` (or the file named by
KILN_CONFIG), `KILN_*` environment variables, then keyword arguments / CLI flags
(the file and the variables are read and checked in sources.py; engine/config/settings_base.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from engine.config.server_settings import ServerSettings
from engine.config.settings_base import (
    LOAD_FORMATS,
    SPECULATIVE_KEYS,
    SUPPORTED_KV_CACHE_DTYPES,
    SUPPORTED_QUANTIZATION,
    KilnSettingsBase,
    default_cache_dir,
)
from engine.config.settings_checks import check_combinations, check_kv_tiers, check_tensor_parallel
from engine.config.values import DTYPE_ALIASES, did_you_mean, json_value, parse_core_list, parse_human_int, word_list


class EngineSettings(KilnSettingsBase):
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="forbid", validate_default=True, enable_decoding=False)

    # --- model ---
    model: str | None = Field(
        None, description="an HF checkpoint directory or a GGUF file (default: kiln's embedded tiny model)"
    )
    tokenizer: str | None = Field(None, description="tokenizer directory (default: the model's)")
    chat_template: str | None = Field(
        None, description="Jinja chat template, or the path of a file holding one (default: the tokenizer's)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and activations (half = float16, float = float32; auto: the checkpoint's; on "
        "the CPU float32, or bf16 for a bf16/fp16 checkpoint where the CPU multiplies bf16 natively; "
        "logged at start-up)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when a GPU is visible")
    seed: int = Field(0, description="random seed for dummy weights and unseeded sampling")
    load_format: str = Field(
        "auto",
        description="auto: the checkpoint's safetensors or GGUF file; safetensors / gguf: that format (an "
        "error where the checkpoint is the other); dummy: random weights from config.json",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="context length in tokens; 32k = 32000, 32K = 32768 (default: the model's max_position_embeddings)",
    )

    # --- KV cache ---
    block_size: int = Field(16, description="tokens per KV block (8, 16, 32, 64 or 128)")
    num_gpu_blocks: int | None = Field(None, ge=2, description="KV blocks; default: sized from memory settings")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="share of GPU memory kiln may use")
    kv_cache_memory_gb: float | None = Field(
        None,
        gt=0.0,
        description="KV cache size on the CPU device, GiB; default: half the memory free once the "
        "weights are loaded (MemAvailable or the cgroup limit, less 1 GiB and the activations), at most what "
        "max_num_seqs sequences at the full context fill, at least 0.25",
    )
    swap_space_gb: float = Field(1.0, ge=0.0, description="pinned CPU memory for swapped-out KV blocks")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of shared prompt prefixes")
    # KV tiers under the block pool (docs/kv_tiers.md): off unless a size, path or URL is set.
    kv_offloading_size: float | None = Field(
        None,
        gt=0.0,
        description="KV tiers: GiB of host memory that keeps prefix blocks evicted from the KV cache (vLLM's "
        "--kv-offloading-size; default: no host tier)",
    )
    kv_disk_path: Path | None = Field(
        None,
        description="KV tiers: a directory that keeps prefix blocks on disk, shared by processes of the same "
        "model and kept across restarts (LMCache's local_disk; default: no disk tier)",
    )
    kv_disk_size_gb: float = Field(
        32.0, gt=0.0, description="KV tiers: GB the disk tier may hold (LMCache's max_local_disk_size)"
    )
    kv_remote_url: str | None = Field(
        None,
        description="KV tiers: redis://HOST:PORT[/DB] of a Redis or Valkey server that replicas share prefix "
        "blocks through (LMCache's remote_url; default: no remote tier)",
    )

    # --- scheduling ---
    max_num_seqs: int = Field(64, ge=1, description="sequences in one batch at most")
    max_num_batched_tokens: int = Field(
        2048,
        ge=1,
        description="tokens in one step at most (prefill chunks + decodes); on the CPU 512 where not set "
        "(llama.cpp's micro-batch: a step's activations are rows of every token in it)",
    )
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps")
    preemption_mode: Literal["auto", "swap", "recompute"] = Field(
        "recompute", description="what happens to a preempted sequence's KV blocks"
    )
    reserved_blocks_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="pool share kept for priority <= reserved_priority"
    )
    reserved_priority: int = Field(0, description="requests with priority <= this may use the reserved share")
    max_waiting_requests: int = Field(4096, ge=1, description="beyond this the server answers 503")
    target_itl_ms: float | None = Field(
        None,
        gt=0,
        description="CPU: inter-token latency target; prefill chunks that ride with decodes are cut to what a "
        "cost model learnt from measured steps says fits: a bounded ITL tail for later first tokens and less "
        "throughput (docs/benchmarks.md, latency under load; default: none, the token budget alone)",
    )
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="with chunked prefill, one prompt's tokens in a step at most, so that short prompts queued "
        "behind a long one start beside it (vLLM's flag; 0: the step's token budget)",
    )
    whole_prompts_first: bool = Field(
        False,
        description="with chunked prefill, waiting prompts that fit whole in a step go before the next piece of a "
        "running long prompt (which keeps at least half the step), so that a short prompt queued behind a long "
        "one has its first token a step later instead of after the long prefill (docs/benchmarks.md)",
    )
    cpu_micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="CPU: where prefill meets decodes, steps of at most this many rows, prefill-only until the "
        "prompts' last tokens run with the decodes (as llama.cpp's micro-batches; 127 kept a quantised model's "
        "layers on its int8 kernels where they switched to a GEMM at 128 rows, at 1.6-3x the cost per token; that "
        "switch is now measured per machine, cpu_quant_gemm_rows: docs/benchmarks.md, first token under load; 0: off)",
    )

    cpu_prefill_wave_tokens: int = Field(
        2048,
        ge=0,
        description="CPU: prompts in flight together have their first tokens together, up to this many prompt rows "
        "(llama.cpp's -b 2048 over -ub 512): their pieces stop one token short until the rest fits one step, so a "
        "sequence with its first token does not wait a whole step for the others' prefill (the ITL p99 of a c16 "
        "wave on a 1.2B model: docs/benchmarks.md, latency under load); decodes run every step as before; 0 or "
        "not above the step's token budget: off",
    )

    # --- speculative decoding (vLLM's speculative_config {"method": "ngram", ...}) ---
    speculative_method: Literal["ngram", "draft_model", "eagle", "eagle3"] | None = Field(
        None,
        description="drafts verified in one forward: ngram (prompt lookup), draft_model (a small model "
        "with the same tokenizer), eagle / eagle3 (an EAGLE head on the model's hidden states)",
    )
    speculative_model: str | None = Field(
        None, description="draft_model / eagle / eagle3: the draft model's or head's checkpoint directory"
    )
    num_speculative_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="draft tokens per step and sequence (at most: "
        "a model's drafts shrink per sequence when few are accepted)",
    )
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix to look up")
    prompt_lookup_min: int = Field(
        2, ge=1, description="ngram: shortest suffix to look up (1 matches by chance too often)"
    )

    # --- LoRA adapters (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank) ---
    enable_lora: bool = Field(False, description="serve LoRA adapters")
    lora_modules: list[str] | None = Field(None, description="name=path of PEFT adapters loaded at start-up")
    max_loras: int = Field(4, ge=1, description="adapters resident at once (one batch may mix them all)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="largest adapter rank accepted")

    # --- embeddings (/v1/embeddings, LLM.embed) ---
    pooling_type: Literal["last", "mean"] = Field("last", description="how prompt hidden states become an embedding")

    # --- compiler / kernels ---
    enforce_eager: bool = Field(False, description="no torch.compile, no CUDA graphs")
    attention_backend: Literal["auto", "torch", "cutlass"] = Field(
        "auto", description="auto: cutlass kernels on a GPU, the torch reference on the CPU"
    )
    cuda_graph_sizes: list[int] | None = Field(None, description="decode batch buckets (default 1,2,4,8,16,...)")
    compile_cache_dir: Path | None = Field(None, description="default: <cache_dir>/compile")
    kernel_cache_dir: Path | None = Field(None, description="default: <cache_dir>/kernels")
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="kiln's cache root (KILN_CACHE_DIR): kernels, compile artefacts, tiny model",
    )
    decode_kernel: Literal["v1", "v2"] = Field(
        "v1",
        description="cutlass backend decode kernel: v1 (split-KV + combine launch, verified on an H200) "
        "or v2 (warp-streamed blocks, in-kernel merge)",
    )
    prefill_kernel: Literal["mma", "wgmma"] = Field(
        "mma",
        description="cutlass backend prefill kernel: mma (mma.sync, verified on an H200) or wgmma "
        "(sm_90a warpgroup MMA)",
    )

    # --- CPU threads (engine/worker/cpu_threads.py) ---
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="compute threads on the CPU; default: one per available core, minus one "
        "(left to the engine loop and the server) from 4 cores up",
    )
    cpu_bind: str = Field(
        "auto",
        description="pin the process to cores: a list like 0-3 or 0,2 (then one thread per core "
        "unless cpu_threads says otherwise); auto and none leave placement to the OS",
    )

    cpu_decoder_stack: bool = Field(
        True,
        description="on the CPU, run a Llama-family model's decoder layers as one C++ call per step "
        "(the same kernels as the eager forward, without Python's dispatch per op) where "
        "every projection runs on the weight-streaming kernels",
    )
    cpu_quant_activations: Literal["auto", "float", "int8"] = Field(
        "auto",
        description="a float32 model's quantised layers (GGUF, GPTQ/AWQ int) on the CPU kernels: float = "
        "weights dequantised in registers against float32 activations (dequantise-then-matmul's products); int8 = "
        "activations quantised to int8 per block of 32 for integer dot products, as llama.cpp does; auto = float "
        "on AMD Zen 5, int8 elsewhere (Zen 4, AVX2-only and Intel CPUs: there the float path is compute-bound, "
        "1.5-2.5x slower). "
        "bf16/fp16 models always take int8",
    )
    cpu_half_weights: bool = Field(
        True,
        description="on the CPU, a float32 model's projection weights that hold only fp16 or bf16 values (an "
        "fp16/bf16 checkpoint run in float32) stay in 2 bytes: the decode kernels widen them in "
        "registers (the same products, half the bytes per step), a prefill's GEMM per call; "
        "such an LM head gets a 2-byte copy for decode steps beside its float32 table",
    )
    cpu_gemm_packed_weights: Literal["auto", "on", "off"] = Field(
        "auto",
        description="on the CPU, keep oneDNN's blocked copy of the dense weights for steps of more rows than "
        "the weight-streaming kernels take (prefill chunks, batches of 32+): no reorder per "
        "call; the weights' bytes once more in memory, at most a quarter of what is free. "
        "auto = on CPUs with AMX (bf16 GEMMs 1.5-2.5x faster there, same bits; float32 1.1-1.3x), "
        "only for a copy of at most 8% of the free memory (memory wins for a 1B+ model: "
        "long prefills lose little without it); on = on any CPU",
    )
    cpu_huge_pages: bool = Field(
        True,
        description="on the CPU, put the weights on 2 MB transparent huge pages (advised before the "
        "load writes them, collapsed after; fewer TLB misses as every step streams them)",
    )
    cpu_compile_forward: bool = Field(
        False,
        description="on the CPU, torch.compile the whole forward too (measured no faster than eager; "
        "only the decode attention is compiled by default)",
    )
    cpu_quant_gemm_rows: int | None = Field(
        None,
        ge=1,
        description="on the CPU, steps of at least this many rows run a quantised layer as a GEMM on its "
        "dequantised weight instead of the weight-streaming kernels; default: the crossover measured on this "
        "machine per kernel family and activation path (`kiln build-kernels --cpu` measures and caches it), "
        "or where not measured 64 rows (float activations) / 128 (int8; never on VNNI kernels, which beat the GEMM "
        "at every row count measured)",
    )

    # --- logging ---
    log_stats_interval: float = Field(10.0, ge=0.0, description="seconds between stats log lines (0 = off)")
    step_timeline: Path | None = Field(
        None,
        description="write one JSON line per engine step here: token counts, model / host time, output "
        "delays, GC pauses (docs/benchmarks.md; kiln bench timeline FILE reads it)",
    )

    # --- engine loop ---
    async_scheduling: bool | None = Field(
        None,
        description="overlap scheduling: the host prepares step N+1 while the device runs step N "
        "(default: on with a GPU, off on the CPU)",
    )
    step_waits_for_outputs: bool = Field(
        False,
        description="served: the next step starts once the previous one's outputs were handed out (their "
        "detokenising and streaming then run between steps, not beside a forward on the same cores)",
    )
    # --- vLLM-compatible settings (issue 13) ---
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks to shard the model over, one process each (GPUs with NCCL; CPU processes with gloo)"
    )
    quantization: str | None = Field(
        None,
        description="fp8: quantise a full-precision checkpoint's linear layers at load (per-channel "
        "scales); default: the checkpoint's own quantization_config (gptq, awq, compressed-tensors)",
    )
    kv_cache_dtype: str = Field(
        "auto",
        description="KV cache element type: auto (the model dtype; on the CPU a float32 model's cache is "
        "float16, see docs/models.md), bfloat16, float16, float32, or fp8 / fp8_e4m3 (1-byte e4m3 with "
        "per-layer K/V scales from the checkpoint, else 1.0 or calculate_kv_scales): twice the blocks of bf16",
    )
    generation_config: str = Field(
        "auto",
        description="auto: sampling defaults and extra EOS ids from the model's generation_config.json; "
        "vllm: ignore it; or a folder holding one",
    )
    max_logprobs: int = Field(20, ge=0, description="largest logprobs / prompt_logprobs a request may ask for")
    disable_log_stats: bool = Field(False, description="no periodic stats log lines")
    speculative_config: dict[str, Any] | None = Field(
        None, description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}; sets the speculative_* settings'
    )
    trust_remote_code: bool = Field(
        False,
        description="accepted for vLLM command lines; kiln never runs a checkpoint's code (GLM/ChatGLM load natively)",
    )
    int4_kernel: Literal["auto", "reference", "kiln", "tinygemm", "packed"] = Field(
        "auto",
        description="int4 weights: auto = kiln's W4A16 GEMM on sm_90 when its cubin is built, else torch's "
        "packed int4 matmul (CPU and CUDA, bf16 models), for every layer whose shape and group size it takes, else "
        "dequantise on the fly; kiln / tinygemm = that kernel (kiln: an error where it cannot run); reference = "
        "always dequantise on the fly; packed = as auto, and float32/float16 models too, their activations rounded "
        "to bf16 around torch's packed kernel (on the CPU far faster than the reference; a bf16 model's numerics)",
    )
    gguf_dequantize: bool = Field(
        False,
        description="GGUF files: dequantise every tensor to the model dtype at load (default: Q4_0/Q4_1 "
        "linear layers of a bf16 model stay int4 in torch's packed layout, Q8_0 ones int8; K-quants are "
        "dequantised either way)",
    )
    calculate_kv_scales: bool = Field(
        False,
        description="fp8 KV cache: set each layer's K/V scales from the first prompt it sees (amax / 448), "
        "instead of the checkpoint's (or 1.0)",
    )

    # --- vLLM flags, second round (issue 44) ---
    override_generation_config: dict[str, Any] | None = Field(
        None,
        description='JSON of sampling defaults over generation_config.json\'s, e.g. {"temperature": 0.5} '
        "(vLLM's keys: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, ...)",
    )

    @field_validator("load_format")
    @classmethod
    def _check_load_format(cls, v: str) -> str:
        if v not in LOAD_FORMATS:
            raise ValueError(f"load format {v!r} is not supported: kiln reads {', '.join(LOAD_FORMATS)}")
        return v

    @field_validator("override_generation_config", mode="before")
    @classmethod
    def _parse_override(cls, v: Any) -> Any:
        return json_value(v, "override_generation_config")

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, v: int) -> int:
        if v not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        return v

    @field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, v: str) -> str:
        if v.strip().lower() not in ("auto", "none"):
            parse_core_list(v)
        return v

    @field_validator("cuda_graph_sizes", "lora_modules", mode="before")
    @classmethod
    def _parse_lists(cls, v: Any) -> Any:
        return word_list(v)

    @field_validator("max_model_len", "max_num_batched_tokens", mode="before")
    @classmethod
    def _parse_sizes(cls, v: Any) -> Any:
        return parse_human_int(v)

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _auto_model_len(cls, v: Any) -> Any:
        return None if v in ("auto", "-1", -1) else v  # vLLM's spellings of "the model's own"

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_aliases(cls, v: Any) -> Any:
        return DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, v: str | None) -> str | None:
        if v is not None and v not in SUPPORTED_QUANTIZATION:
            raise ValueError(
                f"quantization {v!r} is not supported yet (supported: "
                f"{', '.join(SUPPORTED_QUANTIZATION) or 'none; unquantized checkpoints only'})"
            )
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_dtype(cls, v: str) -> str:
        if v == "fp8_e5m2":
            raise ValueError(
                "kv_cache_dtype 'fp8_e5m2' is not supported: kiln's fp8 KV cache is e4m3 with "
                "per-layer scales; use fp8 (= fp8_e4m3)"
            )
        if v not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {v!r} is not supported yet (supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)})"
            )
        return v

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, v: Any) -> Any:
        return json_value(v, "speculative_config")

    @model_validator(mode="before")
    @classmethod
    def _expand_speculative_config(cls, data: Any) -> Any:
        """vLLM's --speculative-config '{"method": "ngram", ...}' sets kiln's speculative_* settings."""
        if not isinstance(data, dict) or data.get("speculative_config") is None:
            return data
        config = json_value(data["speculative_config"], "speculative_config")
        if not isinstance(config, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: unsupported key {unknown[0]!r}{did_you_mean(unknown[0], SPECULATIVE_KEYS)}"
                f" (supported: {', '.join(SPECULATIVE_KEYS)})"
            )
        data = dict(data)
        for key, value in config.items():
            data[SPECULATIVE_KEYS[key]] = value
        return data

    def lora_module_map(self) -> dict[str, str]:
        """lora_modules as {name: path}."""
        return dict(item.split("=", 1) for item in self.lora_modules or [])

    @model_validator(mode="after")
    def _check_combinations(self) -> "EngineSettings":
        """Settings that cannot work together are refused at start-up, by name (settings_checks.py)."""
        if self.disable_log_stats:
            self.log_stats_interval = 0.0
        check_combinations(self)
        check_kv_tiers(self)
        check_tensor_parallel(self)
        return self

    def resolved_chat_template(self) -> str | None:
        """The chat_template setting's text: a readable file's content, else the value itself."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        if "{" not in self.chat_template and not path.is_file():
            raise ValueError(f"chat_template: no such file {self.chat_template!r} (and not a Jinja template)")
        return path.read_text() if "{" not in self.chat_template else self.chat_template

    # Derived paths: one rule each.
    def resolved_compile_cache_dir(self) -> Path:
        return self.compile_cache_dir or self.cache_dir / "compile"

    def resolved_kernel_cache_dir(self) -> Path:
        return self.kernel_cache_dir or self.cache_dir / "kernels"

    def capture_sizes(self) -> list[int]:
        """Decode batch buckets: configured, or 1, 2, 4, 8 and multiples of 8 up to max_num_seqs."""
        if self.cuda_graph_sizes:
            sizes = self.cuda_graph_sizes
        else:
            sizes = [1, 2, 4] + list(range(8, self.max_num_seqs + 8, 8))
        return sorted({min(s, self.max_num_seqs) for s in sizes})

    def resolved_async_scheduling(self, device_type: str) -> bool:
        """async_scheduling as set, else on exactly when the device is a GPU."""
        return self.async_scheduling if self.async_scheduling is not None else device_type == "cuda"

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_disk_path is not None or self.kv_remote_url is not None


# Every setting's name: a kiln.toml key or KILN_* variable naming none of them is refused / warned of.
SETTING_NAMES = frozenset(EngineSettings.model_fields) | frozenset(ServerSettings.model_fields)
