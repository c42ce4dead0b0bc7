"""A model's generation_config.json as request defaults (vLLM's --generation-config).

`auto` (the default) reads the model folder's generation_config.json, `vllm` ignores it, any other
value is a folder holding one. Its sampling fields become the defaults of every request; a field
the request sets wins. Its eos_token_id entries stop generation like the model's own EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from engine.core.params import SamplingParams

# generation_config.json key -> SamplingParams field (the keys vLLM takes from it).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# SamplingParams field -> the OpenAI request fields that set it.
REQUEST_FIELDS = {
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
    "min_p": ("min_p",),
    "repetition_penalty": ("repetition_penalty",),
    "max_tokens": ("max_tokens", "max_completion_tokens"),
}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> default
    eos_token_ids: tuple[int, ...] = ()
    source: Path | None = None


def load_generation_defaults(model_dir: str | Path, setting: str = "auto") -> GenerationDefaults:
    """The defaults the setting asks for (nothing for `vllm` or a model without the file)."""
    if setting == "vllm":
        return GenerationDefaults()
    folder = Path(model_dir) if setting == "auto" else Path(setting).expanduser()
    if setting != "auto" and not folder.is_dir():
        raise ValueError(
            f"generation_config: {setting!r} is not a folder (auto, vllm, or a folder holding generation_config.json)"
        )
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"generation_config: {path} does not exist")
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"generation_config: {path} is not valid JSON: {exc}") from None
    sampling = {SAMPLING_KEYS[k]: v for k, v in raw.items() if k in SAMPLING_KEYS and v is not None}
    if sampling.get("top_k") == 0:
        sampling["top_k"] = -1  # transformers' 0 means off, as kiln's -1
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return GenerationDefaults(sampling, eos_ids, path)


def with_overrides(defaults: GenerationDefaults, overrides: dict[str, Any] | None) -> GenerationDefaults:
    """--override-generation-config: its sampling keys over the file's (vLLM merges them the same way)."""
    if not overrides:
        return defaults
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {unknown}; kiln takes {', '.join(SAMPLING_KEYS)}")
    sampling = dict(defaults.sampling)
    sampling.update({SAMPLING_KEYS[k]: v for k, v in overrides.items() if v is not None})
    if sampling.get("top_k") == 0:
        sampling["top_k"] = -1
    return GenerationDefaults(sampling, defaults.eos_token_ids, defaults.source)


def default_sampling_params(defaults: GenerationDefaults) -> SamplingParams:
    """SamplingParams() with the model's recommended values (what `LLM.generate(prompts)` uses)."""
    return SamplingParams(**defaults.sampling)


def apply_generation_defaults(
    fields: dict[str, Any], defaults: GenerationDefaults, given: Iterable[str]
) -> dict[str, Any]:
    """SamplingParams keyword arguments with the defaults filled in for the fields the request did
    not set (`given`: the request's own field names, e.g. a pydantic model's model_fields_set);
    max_new_tokens caps an unset max_tokens. (The params are then made, and validated, once.)"""
    given = set(given)
    fields = dict(fields)
    for name, value in defaults.sampling.items():
        if any(f in given for f in REQUEST_FIELDS[name]):
            continue
        if name == "max_tokens":
            current = fields.get("max_tokens")
            fields[name] = value if current is None else min(value, current)
        else:
            fields[name] = value
    return fields
