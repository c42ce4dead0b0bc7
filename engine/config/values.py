"""How setting values may be written: vLLM's size and dtype spellings, lists as words or JSON,
JSON objects, and "did you mean" for misspelt names. Pure functions, no settings here."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any


def did_you_mean(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_human_int(value: Any) -> Any:
    """vLLM's size syntax: 32k = 32000, 32K = 32768, 1m = 10**6, 1M = 2**20, 25.6k = 25600."""
    if not isinstance(value, str):
        return value
    text = value.strip().replace("_", "")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text)
    if not match:
        return value  # pydantic reports it
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    result = float(number) * scale
    if result != int(result):
        raise ValueError(f"{value!r} is not a whole number of tokens")
    return int(result)


# vLLM's dtype spellings.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def json_value(value: Any, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    return value


def word_list(value: Any) -> Any:
    """A list setting given as one string: JSON list, or comma/space separated words."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [x for x in re.split(r"[,\s]+", text) if x]
    if (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], str)
        and ("," in value[0] or value[0].lstrip().startswith("["))
    ):
        return word_list(value[0])
    return value


def parse_core_list(text: str) -> list[int]:
    """'0,2,4-7' -> [0, 2, 4, 5, 6, 7]; ValueError on anything else."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu_bind: expected auto, none or a core list like 0,1 or 0-3; got {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu_bind: range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"cpu_bind: empty core list {text!r}")
    return sorted(cores)
