"""EngineSettings: the one place where kiln's settings are defined.

Sources, lowest to highest priority: defaults, `kiln.toml` (or the file named by
KILN_CONFIG), `KILN_*` environment variables, then keyword arguments / CLI flags.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource


def default_cache_dir() -> Path:
    """kiln's cache directory (default model, kernels, compile artefacts)."""
    base = os.environ.get("KILN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln")
    return Path(base)


def config_file_path() -> Path:
    return Path(os.environ.get("KILN_CONFIG", "kiln.toml"))


def export_compile_cache_dir(path: Path) -> tuple[Path, bool]:
    """Point Inductor's cache root (read only from the process environment) at `path`.

    The one place kiln writes the environment. Returns the resolved path and whether it changed.
    """
    resolved = Path(path).expanduser().resolve()
    changed = os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(resolved)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(resolved)
    return resolved, changed


def env_flag(name: str) -> str | None:
    """Read one process-level knob that is not an engine setting (e.g. test soak length)."""
    return os.environ.get(name)


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="forbid", validate_default=True)

    # --- model ---
    model: str | None = Field(None, description="HF checkpoint directory (default: kiln's embedded tiny model)")
    tokenizer: str | None = Field(None, description="tokenizer directory (default: the model's)")
    chat_template: str | None = Field(
        None, description="Jinja chat template, or the path of a file holding one (default: the tokenizer's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy: random weights from config.json")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's max_position_embeddings")

    # --- KV cache ---
    block_size: int = Field(16, description="tokens per KV block (8, 16, 32, 64 or 128)")
    num_gpu_blocks: int | None = Field(None, ge=2, description="KV blocks; default: sized from memory settings")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_gb: float = Field(0.25, gt=0.0, description="KV cache size on the CPU device")
    swap_space_gb: float = Field(1.0, ge=0.0, description="pinned CPU memory for swapped-out KV blocks")
    enable_prefix_caching: bool = True

    # --- scheduling ---
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["auto", "swap", "recompute"] = "recompute"
    reserved_blocks_fraction: float = Field(0.0, ge=0.0, lt=1.0,
                                            description="pool share kept for priority <= reserved_priority")
    reserved_priority: int = 0
    max_waiting_requests: int = Field(4096, ge=1, description="beyond this the server answers 503")

    # --- speculative decoding (vLLM's speculative_config {"method": "ngram", ...}) ---
    speculative_method: Literal["ngram"] | None = Field(
        None, description="ngram: draft tokens by prompt lookup, verified in one forward")
    num_speculative_tokens: int = Field(0, ge=0, le=16, description="draft tokens per step and sequence")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix to look up")
    prompt_lookup_min: int = Field(2, ge=1,
                                   description="ngram: shortest suffix to look up (1 matches by chance too often)")

    # --- LoRA adapters (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank) ---
    enable_lora: bool = False
    lora_modules: list[str] | None = Field(None, description="name=path of PEFT adapters loaded at start-up")
    max_loras: int = Field(4, ge=1, description="adapters resident at once (one batch may mix them all)")
    max_lora_rank: int = Field(16, ge=1, le=512)

    # --- embeddings (/v1/embeddings, LLM.embed) ---
    pooling_type: Literal["last", "mean"] = Field("last", description="how prompt hidden states become an embedding")

    # --- compiler / kernels ---
    enforce_eager: bool = Field(False, description="no torch.compile, no CUDA graphs")
    attention_backend: Literal["auto", "torch", "cutlass"] = "auto"
    cuda_graph_sizes: list[int] | None = Field(None, description="decode batch buckets (default 1,2,4,8,16,...)")
    compile_cache_dir: Path | None = Field(None, description="default: <cache_dir>/compile")
    kernel_cache_dir: Path | None = Field(None, description="default: <cache_dir>/kernels")
    cache_dir: Path = Field(default_factory=default_cache_dir)

    # --- CPU threads (engine/cpu_threads.py) ---
    cpu_threads: int | None = Field(
        None, ge=1, description="compute threads on the CPU; default: one per available core, minus one "
                                "(left to the engine loop and the server) from 4 cores up")
    cpu_bind: str = Field(
        "auto", description="pin the process to cores: a list like 0-3 or 0,2 (then one thread per core "
                            "unless cpu_threads says otherwise); auto and none leave placement to the OS")

    cpu_compile_forward: bool = Field(
        False, description="on the CPU, torch.compile the whole forward too (measured no faster than eager; "
                           "only the decode attention is compiled by default)")

    # --- logging ---
    log_stats_interval: float = Field(10.0, ge=0.0, description="seconds between stats log lines (0 = off)")

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, v: int) -> int:
        if v not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        return v

    @field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, v: str) -> str:
        from engine.cpu_threads import parse_core_list

        if v.strip().lower() not in ("auto", "none"):
            parse_core_list(v)
        return v

    @field_validator("cuda_graph_sizes", mode="before")
    @classmethod
    def _parse_sizes(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [int(x) for x in v.replace(" ", "").split(",") if x]
        return v

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x for x in v.replace(" ", "").split(",") if x]
        return v

    def lora_module_map(self) -> dict[str, str]:
        """lora_modules as {name: path}."""
        return dict(item.split("=", 1) for item in self.lora_modules or [])

    @model_validator(mode="after")
    def _check_combinations(self) -> "EngineSettings":
        if self.max_model_len is not None and not self.enable_chunked_prefill \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with enable_chunked_prefill off: long prompts could never be scheduled")
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError("cuda_graph_sizes must be positive batch sizes")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        for item in self.lora_modules or []:
            if "=" not in item or not item.split("=", 1)[0] or not item.split("=", 1)[1]:
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        if len(self.lora_module_map()) > self.max_loras:
            raise ValueError(f"lora_modules lists {len(self.lora_module_map())} adapters; "
                             f"max_loras is {self.max_loras}")
        if self.speculative_method is not None and self.num_speculative_tokens < 1:
            raise ValueError("speculative_method needs num_speculative_tokens >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = config_file_path()
        if path.is_file():
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

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


class ServerSettings(BaseSettings):
    """HTTP server settings (`kiln serve`)."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    warm_prefixes: Path | None = None
    request_timeout: float | None = Field(None, gt=0, description="seconds before a request is aborted")
    log_level: str = "info"
    # Tool calling with tool_choice "auto": the model's own call format is parsed (vLLM's flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = False
    # Split chat answers into reasoning_content and content (vLLM's --reasoning-parser).
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> "ServerSettings":
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes or llama3_json)")
        return self

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None


ENGINE_FIELDS = tuple(EngineSettings.model_fields)
