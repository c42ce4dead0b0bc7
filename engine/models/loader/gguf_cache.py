"""What transformers derives from a GGUF file's metadata (its HF config dict and its tokenizer),
kept on disk so a warm start reads them back in a fraction of a second instead of rebuilding them
from the file's vocabulary and merges (seconds for a 49k vocabulary: issue 40).

An entry lives in <cache_dir>/gguf/<fingerprint>/: config.json and tokenizer/ (the tokenizer's
save_pretrained). The fingerprint hashes the file's header (every metadata key and the tensor
table: all that the config and the tokenizer are made from) with the versions of the code that
made them, so an edited file, or a new transformers, gets a new entry; a copy of the same file
finds the old one. Entries are written whole (a temporary directory renamed into place), so a
reader never sees half of one; a cache that cannot be written costs only the rebuild.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

FORMAT = 1  # (bump when what an entry holds changes)
_CHUNK = 1 << 20


def _versions() -> str:
    out = [f"kiln-gguf-cache-{FORMAT}"]
    for package in ("transformers", "tokenizers"):
        try:
            out.append(f"{package}-{version(package)}")
        except PackageNotFoundError:
            out.append(f"{package}-none")
    return " ".join(out)


def fingerprint(path: str | Path, header_end: int) -> str:
    """A hash of the file's first header_end bytes (its header: up to the first tensor's data) and
    the code versions."""
    digest = hashlib.sha256(_versions().encode())
    with open(path, "rb") as f:
        left = header_end
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()[:32]


def entry_dir(path: str | Path, header_end: int, cache_dir: Path) -> Path:
    return cache_dir / "gguf" / fingerprint(path, header_end)


def _publish(entry: Path, name: str, write: Callable[[Path], None]) -> None:
    """Write `name` inside `entry` through a temporary sibling renamed into place (atomic: another
    process starting the same file at once either wins the rename or finds the entry there)."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=entry))
        try:
            write(tmp)
            try:
                os.rename(tmp, entry / name)
            except OSError:
                if not (entry / name).is_dir():  # (else another process published it first)
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("GGUF cache: cannot write %s (%s); the next start rebuilds it", entry / name, exc)


def cached_config(
    path: str | Path, header_end: int, cache_dir: Path | None, build: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """build() (transformers' config dict of the file), or the one an earlier start saved; either
    way as JSON gives it back (id2label's keys are strings)."""
    if cache_dir is None:
        return build()
    entry = entry_dir(path, header_end, cache_dir)
    file = entry / "config" / "config.json"
    if file.is_file():
        try:
            return json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("GGUF cache: unreadable %s (%s): rebuilding it", file, exc)
            shutil.rmtree(file.parent, ignore_errors=True)
    text = json.dumps(build())
    _publish(entry, "config", lambda d: (d / "config.json").write_text(text))
    return json.loads(text)  # (as a later start reads it: JSON's string keys)


def cached_tokenizer(path: str | Path, header_end: int, cache_dir: Path | None, build: Callable[[], Any]) -> Any:
    """build() (transformers' tokenizer of the file), or the one an earlier start saved: read with
    the class that built it (AutoTokenizer's lookup imports transformers' model registry, ~0.4 s)."""
    if cache_dir is None:
        return build()
    entry = entry_dir(path, header_end, cache_dir)
    saved = entry / "tokenizer"
    if saved.is_dir():
        try:
            return _tokenizer_class(saved).from_pretrained(str(saved))
        except (OSError, ValueError, KeyError, AttributeError, ImportError) as exc:
            logger.warning("GGUF cache: unreadable tokenizer in %s (%s): rebuilding it", saved, exc)
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = build()

    def write(d: Path) -> None:
        tokenizer.save_pretrained(str(d))
        cls = type(tokenizer)
        (d / _CLASS_FILE).write_text(json.dumps({"module": cls.__module__, "name": cls.__qualname__}))

    _publish(entry, "tokenizer", write)
    logger.info("GGUF tokenizer converted once, kept in %s for the next start", saved)
    return tokenizer


_CLASS_FILE = "kiln_tokenizer_class.json"


def _tokenizer_class(saved: Path):
    where = json.loads((saved / _CLASS_FILE).read_text())
    return getattr(import_module(where["module"]), where["name"])
