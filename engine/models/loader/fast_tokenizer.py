"""kiln's own fast-loading form of a tokenizer: the `tokenizers.Tokenizer` transformers' tokenizer
runs on, saved with the few facts kiln reads (special ids, split_special_tokens), so a warm start
loads it in milliseconds without importing transformers (a second of a two-core start: issue 40).

The first start with a tokenizer loads it through transformers, as before, and writes the form into
kiln's cache (an entry per tokenizer: the GGUF header's hash, or the tokenizer files' contents, with
the transformers and tokenizers versions); later starts get a KilnTokenizer from it. What kiln does
on every request runs on that backend exactly as transformers' TokenizersBackend runs it (encode,
decode, len, get_vocab, the special ids: tests/models/test_fast_tokenizer.py checks them against
transformers). Everything else (chat templates, save_pretrained, ...) goes to transformers'
tokenizer, loaded on first use; the server starts loading it once it is ready. A tokenizer whose
encode or decode transformers changes (a subclass of its own, decode's clean-up of spaces) gets no
fast form and stays transformers' own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

FORMAT = 1  # (bump when what an entry holds changes)
FACTS_FILE = "kiln_fast_tokenizer.json"
BACKEND_FILE = "tokenizer.json"
# What AutoTokenizer reads from a tokenizer directory: an entry's key hashes what of these is there.
_DIR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)
# transformers' methods whose behaviour the fast form reproduces: a class that overrides any of
# them gets none.
_SAME_AS_BACKEND = ("encode", "decode", "_decode", "_encode_plus", "__len__", "get_vocab")
_SPECIAL = ("eos", "bos", "pad", "unk")


class KilnTokenizer:
    """A tokenizer read from kiln's fast form: encode, decode, len, get_vocab and the special ids
    here; any other attribute is transformers' tokenizer's (`transformers_tokenizer`, loaded on first use)."""

    def __init__(self, backend: Any, facts: dict[str, Any], load_full: Callable[[], Any], name: str) -> None:
        self.backend_tokenizer = backend
        self.name_or_path = name
        self.split_special_tokens = bool(facts["split_special_tokens"])
        for kind in _SPECIAL:
            setattr(self, f"{kind}_token", facts.get(f"{kind}_token"))
            setattr(self, f"{kind}_token_id", facts.get(f"{kind}_token_id"))
        self._load_full = load_full
        self._full: Any = None
        self._full_lock = threading.Lock()
        self._chat_template: Any = None  # (set by kiln: --chat-template; handed to the full tokenizer)
        # As transformers' encode sets them: no truncation, no padding, special tokens kept whole.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = self.split_special_tokens

    @classmethod
    def read(cls, entry: Path, load_full: Callable[[], Any], name: str) -> "KilnTokenizer":
        from tokenizers import Tokenizer

        facts = json.loads((entry / FACTS_FILE).read_text())
        if facts.get("format") != FORMAT:
            raise ValueError(f"format {facts.get('format')} (this kiln reads {FORMAT})")
        return cls(Tokenizer.from_file(str(entry / BACKEND_FILE)), facts, load_full, name)

    # ---- what kiln calls per request: the backend, as transformers calls it ----
    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or any(not isinstance(t, int) for t in token_ids):
            return self.transformers_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    # ---- the rest: transformers' tokenizer ----
    @property
    def chat_template(self) -> Any:
        return self._chat_template if self._chat_template is not None else self.transformers_tokenizer.chat_template

    @chat_template.setter
    def chat_template(self, template: Any) -> None:
        self._chat_template = template
        if self._full is not None:
            self._full.chat_template = template

    @property
    def transformers_tokenizer(self) -> Any:
        """transformers' tokenizer of the same files (loaded once, on first use)."""
        with self._full_lock:
            if self._full is None:
                full = self._load_full()
                if self._chat_template is not None:
                    full.chat_template = self._chat_template
                self._full = full
            return self._full

    def load_full_in_background(self) -> None:
        """Load transformers' tokenizer on a thread now (the server, once ready), so the first
        chat request finds it loaded."""
        threading.Thread(target=lambda: self.transformers_tokenizer, name="kiln-tokenizer-full", daemon=True).start()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_load_full", "_full_lock", "_chat_template"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    def __repr__(self) -> str:
        return f"KilnTokenizer({self.name_or_path!r}, vocabulary {len(self)})"


def facts_of(tokenizer: Any) -> dict[str, Any] | None:
    """The facts of transformers' `tokenizer` that kiln's form keeps, or None where it cannot be
    reproduced from its backend alone."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (another transformers: no fast form)
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    if any(getattr(cls, m, None) is not getattr(TokenizersBackend, m, None) for m in _SAME_AS_BACKEND):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and not _cleanup_skipped(tokenizer):
        return None
    facts: dict[str, Any] = {"format": FORMAT, "split_special_tokens": bool(tokenizer.split_special_tokens)}
    for kind in _SPECIAL:
        facts[f"{kind}_token"] = _text(getattr(tokenizer, f"{kind}_token", None))
        facts[f"{kind}_token_id"] = getattr(tokenizer, f"{kind}_token_id", None)
    return facts


def _cleanup_skipped(tokenizer: Any) -> bool:
    """transformers skips decode's clean-up of spaces for a BPE model (unless forced)."""
    return type(tokenizer.backend_tokenizer.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )


def _text(token: Any) -> str | None:
    return None if token is None else str(token)


def write(tokenizer: Any, entry: Path) -> bool:
    """Write kiln's form of `tokenizer` into `entry` (whole, through a renamed temporary folder);
    False where it has none or the cache cannot be written."""
    facts = facts_of(tokenizer)
    if facts is None:
        return False
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        try:
            (tmp / BACKEND_FILE).write_text(tokenizer.backend_tokenizer.to_str())
            (tmp / FACTS_FILE).write_text(json.dumps(facts))
            try:
                os.rename(tmp, entry)
            except OSError:
                if not (entry / FACTS_FILE).is_file():  # (else another start wrote it first)
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("tokenizer cache: cannot write %s (%s); the next start loads transformers' again", entry, exc)
        return False
    return True


def load(entry: Path | None, load_full: Callable[[], Any], name: str) -> Any:
    """kiln's form from `entry` where an earlier start wrote it; else load_full() (transformers'
    tokenizer), whose form is written there for the next start."""
    if entry is not None and (entry / FACTS_FILE).is_file():
        try:
            return KilnTokenizer.read(entry, load_full, name)
        except Exception as exc:  # noqa: BLE001 - a damaged entry costs only transformers' load
            logger.warning("tokenizer cache: unreadable %s (%s): loading the tokenizer with transformers", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = load_full()
    if entry is not None and write(tokenizer, entry):
        logger.info("tokenizer: kiln's fast form kept in %s for the next start", entry)
    return tokenizer


def versions() -> str:
    out = [f"kiln-fast-tokenizer-{FORMAT}"]
    for package in ("transformers", "tokenizers"):
        try:
            out.append(f"{package}-{version(package)}")
        except PackageNotFoundError:
            out.append(f"{package}-none")
    return " ".join(out)


def dir_entry(path: str | Path, cache_dir: Path) -> Path | None:
    """The cache entry of a tokenizer directory (None without a tokenizer.json: no fast form)."""
    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        return None
    digest = hashlib.sha256(versions().encode())
    for name in _DIR_FILES:
        f = p / name
        if f.is_file():
            digest.update(f"\0{name}\0".encode())
            digest.update(f.read_bytes())
    return cache_dir / "tokenizers" / digest.hexdigest()[:32]
