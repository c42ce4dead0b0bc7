"""Check a PEFT LoRA directory's files before the engine loads them: a corrupt adapter is an
InvalidRequestError naming the file and what is wrong, never a crash in the loader.

Runtime loading (/v1/load_lora_adapter) is confined first: the path must lie under one of the
operator's lora_adapter_roots (symlinks resolved), and every path that does not name an adapter
directory there gets one and the same refusal, which says nothing about the filesystem (not
whether the path exists, is a file, or is too long). Only inside the roots do refusals name files.

The checks read only adapter_config.json and the safetensors header (not the weights): the
config must be a JSON object with a positive integer rank; the header must be JSON whose every
tensor has a known dtype, a shape, and data offsets that match them and lie inside the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from engine.core.admission_rules import InvalidRequestError
from engine.models.loader.safetensors_reader import read_header

MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 256


def _not_loadable() -> InvalidRequestError:
    return InvalidRequestError(
        "lora_path: not a LoRA adapter directory under the server's lora_adapter_roots", "lora_path"
    )


def confined_adapter_dir(path: str, roots: list[Path]) -> Path:
    """The directory `path` names, resolved, if it lies under one of `roots` (resolved already);
    else the one uniform refusal."""
    if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise _not_loadable()
    try:
        resolved = Path(path).expanduser().resolve()
        if not any(resolved.is_relative_to(root) for root in roots) or not resolved.is_dir():
            raise _not_loadable()
    except (OSError, RuntimeError, ValueError):  # (too long, a symlink loop, ...): the same refusal
        raise _not_loadable() from None
    return resolved


def check_adapter_name(name: str, reserved: list[str]) -> None:
    """A runtime adapter's name: printable, no spaces, and not a name the base model answers to."""
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or any(c.isspace() for c in name):
        raise InvalidRequestError(f"lora_name: 1 to {MAX_NAME_CHARS} printable characters without spaces", "lora_name")
    if name in reserved:
        raise InvalidRequestError(f"lora_name: {name!r} is the base model's name", "lora_name")


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
    with open(file, "rb") as f:
        try:
            read_header(f, file.stat().st_size)
        except ValueError as exc:
            raise _bad(file, str(exc)) from None


def check_adapter_dir(path: str) -> None:
    """InvalidRequestError (param lora_path) naming the file if the adapter at `path` is corrupt."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise InvalidRequestError(f"lora_path: {path} is not a directory", "lora_path")
    check_adapter_config(root / "adapter_config.json")
    check_safetensors(root / "adapter_model.safetensors")
