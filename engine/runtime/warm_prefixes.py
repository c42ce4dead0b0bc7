"""Prefix warm-up: `kiln serve --warm-prefixes FILE`.

FILE is either
  * a JSON list, each item a prompt string, a list of token ids, or a chat prefix (a list of
    {"role", "content"} messages, rendered with the tokenizer's chat template without a
    generation prompt, exactly as a chat request starting with those messages is rendered); or
  * plain text: one prompt per non-empty line.
At start-up the engine computes these prefixes and pins their full KV blocks in the prefix
cache (`LLMEngine.warm_prefixes` admits them, `EngineCore.warm_prefixes` runs and pins them): they
are never evicted, and every request that starts with one of them skips its prefill.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

from engine.core.admission_rules import InvalidRequestError
from engine.core.params import SamplingParams

logger = logging.getLogger(__name__)


class WarmPrefixError(ValueError):
    pass


def _encode_item(item: Any, tokenizer, where: str) -> list[int]:
    if isinstance(item, str):
        if not item:
            raise WarmPrefixError(f"{where}: empty prompt")
        return list(tokenizer.encode(item))
    if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return list(item)
    if isinstance(item, list) and item and all(isinstance(m, dict) for m in item):
        for m in item:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise WarmPrefixError(f"{where}: chat messages need string 'role' and 'content'")
        text = tokenizer.apply_chat_template(item, tokenize=False, add_generation_prompt=False)
        # The template carries the special tokens itself (as LLM.chat does).
        return list(tokenizer.encode(text, add_special_tokens=False))
    raise WarmPrefixError(
        f"{where}: expected a prompt string, a list of token ids or a list of chat messages, got {type(item).__name__}"
    )


def load_warm_prefixes(path: str | Path, tokenizer) -> list[list[int]]:
    """Read a warm-prefix file into token id lists (see the module docstring for the format)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WarmPrefixError(f"warm prefixes: cannot read {path}: {exc}") from exc
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WarmPrefixError(f"warm prefixes: {path} looks like JSON but does not parse: {exc}") from exc
        if not isinstance(items, list):
            raise WarmPrefixError(f"warm prefixes: {path} must hold a JSON list")
        return [_encode_item(item, tokenizer, f"{path}: item {i}") for i, item in enumerate(items)]
    return [list(tokenizer.encode(line)) for line in text.splitlines() if line.strip()]


def warm_up_from_file(engine, path: str | Path) -> int:
    """Load FILE and pin its prefixes in `engine` (an idle LLMEngine); returns the pinned block count."""
    return engine.warm_prefixes(load_warm_prefixes(path, engine.tokenizer))


def warm_prefixes(engine, token_id_lists: list[list[int]]) -> int:
    """Compute these prefixes' KV and pin their full blocks in `engine`'s prefix cache for good.

    Call before serving, on an idle engine (an LLMEngine: the front admits each prefix as a
    one-token request, its EngineCore runs them and pins their full blocks: never evicted, shared
    by every request that starts with them). Returns the number of pinned blocks in the pool
    (metric: pool.num_pinned).
    """
    core = engine.core
    pool = core.pool
    if not token_id_lists:
        return pool.num_pinned
    if not engine.settings.enable_prefix_caching:
        logger.warning("warm prefixes ignored: prefix caching is off")
        return pool.num_pinned
    if core.has_unfinished_requests():
        raise RuntimeError("warm_prefixes() needs an idle engine (call it before serving)")
    bs = engine.settings.block_size
    admitted = []
    for i, prefix in enumerate(token_id_lists):
        prefix = list(prefix)
        if len(prefix) < bs:
            logger.warning("warm prefix %d has %d tokens, less than one block of %d: skipped", i, len(prefix), bs)
            continue
        rid = f"warm-prefix-{i}-{uuid.uuid4().hex[:8]}"
        try:
            admitted.append(
                engine.admission.admit(
                    prefix, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True), rid
                )
            )
        except InvalidRequestError as exc:  # (nothing was queued yet)
            raise ValueError(f"warm prefix {i}: {exc}") from exc
    return core.warm_prefixes(admitted)
