"""What every settings class shares: the sources they read (kiln.toml, KILN_* variables, keyword
arguments), the cache directory's default, and the values some settings choose among.

The classes themselves: EngineSettings (engine/config/settings.py) and ServerSettings
(engine/config/server_settings.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from engine.config.sources import ConfigFileSource


def default_cache_dir() -> Path:
    """kiln's cache directory (default model, kernels, compile artefacts)."""
    base = os.environ.get("KILN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln"
    )
    return Path(base)


# Quantization methods and KV cache dtypes the engine implements (the quantization work extends these).
SUPPORTED_QUANTIZATION: tuple[str, ...] = ("fp8", "gptq", "awq", "compressed-tensors")  # engine/layers/quant/config.py
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = (  # engine/layers/kv_cache.py
    "auto",
    "fp8",
    "fp8_e4m3",
    "bfloat16",
    "float16",
    "float32",
)

# --load-format values kiln reads (vLLM's others: pt, npcache, tensorizer, sharded_state, bitsandbytes, ...).
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")

SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
}


class KilnSettingsBase(BaseSettings):
    """Sources, highest priority first: keyword arguments (flags), KILN_* variables, kiln.toml."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # A kiln.toml key may name any class's setting (one file configures engine and server).
        names = frozenset().union(*(c.model_fields for c in KilnSettingsBase.__subclasses__()))
        return init_settings, env_settings, ConfigFileSource(settings_cls, names)
