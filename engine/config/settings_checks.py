"""The checks of EngineSettings that span several settings: what cannot work together is refused
at start-up, by name, before anything is built. Called by EngineSettings' one after-validator
(engine/config/settings.py); each raises ValueError, which pydantic reports as a settings error.
"""

from __future__ import annotations

from typing import Protocol


class CheckedSettings(Protocol):
    """What the checks read of EngineSettings (read through this, not an import of settings.py, which
    imports this module: no import circle, and mypy still checks each read at the caller)."""

    @property
    def max_model_len(self) -> int | None: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def cuda_graph_sizes(self) -> list[int] | None: ...
    @property
    def enable_lora(self) -> bool: ...
    @property
    def lora_modules(self) -> list[str] | None: ...
    @property
    def max_loras(self) -> int: ...
    def lora_module_map(self) -> dict[str, str]: ...
    @property
    def speculative_method(self) -> str | None: ...
    @property
    def speculative_model(self) -> str | None: ...
    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def prompt_lookup_min(self) -> int: ...
    @property
    def prompt_lookup_max(self) -> int: ...
    @property
    def kv_tiers_enabled(self) -> bool: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def calculate_kv_scales(self) -> bool: ...
    @property
    def kv_remote_url(self) -> str | None: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def cpu_compile_forward(self) -> bool: ...
    @property
    def kv_cache_dtype(self) -> str: ...


def check_combinations(s: CheckedSettings) -> None:
    """Scheduling, LoRA and speculative settings that contradict each other."""
    if s.max_model_len is not None and not s.enable_chunked_prefill and s.max_num_batched_tokens < s.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({s.max_num_batched_tokens}) is smaller than max_model_len "
            f"({s.max_model_len}) with enable_chunked_prefill off: long prompts could never be scheduled"
        )
    if s.cuda_graph_sizes is not None and any(size < 1 for size in s.cuda_graph_sizes):
        raise ValueError("cuda_graph_sizes must be positive batch sizes")
    if s.lora_modules and not s.enable_lora:
        raise ValueError("lora_modules needs enable_lora")
    for item in s.lora_modules or []:
        if "=" not in item or not item.split("=", 1)[0] or not item.split("=", 1)[1]:
            raise ValueError(f"lora_modules: expected name=path, got {item!r}")
    if len(s.lora_module_map()) > s.max_loras:
        raise ValueError(f"lora_modules lists {len(s.lora_module_map())} adapters; max_loras is {s.max_loras}")
    if s.speculative_method is not None and s.num_speculative_tokens < 1:
        raise ValueError("speculative_method needs num_speculative_tokens >= 1")
    if s.speculative_method in ("draft_model", "eagle", "eagle3") and not s.speculative_model:
        raise ValueError(
            f"speculative_method {s.speculative_method!r} needs speculative_model (the draft's "
            'checkpoint directory: "model" in speculative_config)'
        )
    if s.speculative_model and s.speculative_method in (None, "ngram"):
        raise ValueError("speculative_model is for speculative_method draft_model, eagle or eagle3")
    if s.prompt_lookup_min > s.prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min ({s.prompt_lookup_min}) exceeds prompt_lookup_max ({s.prompt_lookup_max})")


def refused_names(reasons: tuple[tuple[str, bool], ...]) -> list[str]:
    """The names of the reasons that hold."""
    return [name for name, on in reasons if on]


def check_kv_tiers(s: CheckedSettings) -> None:
    """What the KV tiers cannot keep correctly."""
    if not s.kv_tiers_enabled:
        return
    refused = refused_names(
        (
            ("enable_prefix_caching off", not s.enable_prefix_caching),
            ("calculate_kv_scales (scales set after blocks may have loaded)", s.calculate_kv_scales),
            ("tensor_parallel_size > 1", s.tensor_parallel_size > 1),
            ("a draft model or EAGLE head (its KV is not kept)", s.speculative_model is not None),
        )
    )
    if refused:
        raise ValueError(
            f"KV tiers (kv_offloading_size, kv_disk_path, kv_remote_url) do not work with {', '.join(refused)}"
        )
    if s.kv_remote_url is not None:
        from engine.core.kv.tiers.resp import parse_url

        parse_url(s.kv_remote_url)


def check_tensor_parallel(s: CheckedSettings) -> None:
    """What tensor parallelism does not support yet."""
    tp = s.tensor_parallel_size
    if tp == 1:
        return
    refused = refused_names(
        (
            ("enable_lora", s.enable_lora),
            ("quantization", s.quantization is not None),
            ("cpu_compile_forward", s.cpu_compile_forward),
            ("kv_cache_dtype", s.kv_cache_dtype != "auto"),
            ("speculative_model", s.speculative_model is not None),
        )
    )
    if refused:
        raise ValueError(
            f"tensor_parallel_size={tp}: {', '.join(refused)} is not supported with tensor "
            "parallelism yet (use tensor_parallel_size=1)"
        )
