"""Check a PEFT LoRA directory's files before the engine loads them: a corrupt adapter is an
InvalidRequestError naming the file and what is wrong, never a crash in the loader.

The checks read only adapter_config.json and the safetensors header (not the weights): the
config must be a JSON object with a positive integer rank; the header must be JSON whose every
tensor has a known dtype, a shape, and data offsets that match them and lie inside the file.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from engine.core.request import InvalidRequestError
from engine.models.loader.safetensors_reader import DTYPE_BYTES

_MAX_HEADER = 100 << 20


def _bad(file: Path, why: str, param: str = "lora_path") -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {file.name} in {file.parent} {why}", param)


def check_adapter_config(file: Path) -> dict:
    if not file.is_file():
        raise _bad(file, "does not exist (not a PEFT LoRA adapter directory?)")
    try:
        cfg = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(file, f"is not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from exc
    if not isinstance(cfg, dict):
        raise _bad(file, "must hold a JSON object")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad(file, f"needs 'r', a positive integer rank (got {rank!r})")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _bad(file, f"has a non-numeric lora_alpha ({alpha!r})")
    for key in ("target_modules", "modules_to_save"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, (str, list)):
            raise _bad(file, f"has a malformed {key} ({type(value).__name__})")
    return cfg


def check_safetensors(file: Path) -> None:
    if not file.is_file():
        raise _bad(file, "does not exist")
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(file, "is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise _bad(file, "is not a safetensors file (its header length is impossible)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(file, "is not a safetensors file (its header is not JSON)") from exc
    if not isinstance(header, dict):
        raise _bad(file, "is not a safetensors file (its header is not a JSON object)")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise _bad(file, f"is corrupt: tensor {name!r} has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise _bad(file, f"is corrupt: tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _bad(file, f"is corrupt: tensor {name!r} has a malformed shape")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise _bad(file, f"is corrupt: tensor {name!r} lies outside the file")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise _bad(file, f"is corrupt: tensor {name!r}'s size does not match its shape")


def check_adapter_dir(path: str) -> None:
    """InvalidRequestError (param lora_path) naming the file if the adapter at `path` is corrupt."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise InvalidRequestError(f"lora_path: {path} is not a directory", "lora_path")
    check_adapter_config(root / "adapter_config.json")
    check_safetensors(root / "adapter_model.safetensors")
