"""Structured outputs: constrain a request's tokens to a JSON schema, any JSON object, a regex,
a choice of strings or an EBNF grammar.

xgrammar (what vLLM and SGLang use) compiles each constraint against the tokenizer's
vocabulary once (cached by the constraint's text). Every sample of a constrained request
has its own matcher: before each sampling step the sampler asks it for the bitmask of tokens
that keep the output in the language (`fill_bitmask`), and after it the engine feeds it the
chosen token (`accept`). A matcher that has accepted a stop token is terminated, and its
sequence finishes with reason "stop".

xgrammar is imported on first use: it costs seconds to import, and most servers never see
a constrained request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

import torch

from engine.request import InvalidRequestError, StructuredOutputsParams

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and "Check failed: ... is false: ").
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit t % 32 of word t // 32: token t is allowed)."""
    return -(-vocab_size // 32)


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bool [rows, vocab_size], True where the token is allowed."""
    # Bytes of the little-endian words, so token t is bit t % 8 of byte t // 8 (a quarter of the
    # temporaries that shifting whole words would make).
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return ((mask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


class GrammarMatcher:
    """One sample's position in its constraint's language. With reasoning markers the matcher
    waits, allowing every token, until the output closes the thinking block."""

    def __init__(self, matcher: Any, end_marker: tuple[int, ...] | None = None, waiting: bool = False) -> None:
        self._matcher = matcher
        self._end = end_marker
        self.waiting = waiting  # inside the reasoning block: not constrained yet
        self._recent: list[int] = []

    def fill_bitmask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 CPU bitmask."""
        if self.waiting:
            mask[row] = -1  # every token
            return
        self._matcher.fill_next_token_bitmask(mask, row)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the language does not allow it (the matcher is unchanged)."""
        if self.waiting:
            self._recent = (self._recent + [token])[-len(self._end):]
            self.waiting = tuple(self._recent) != self._end
            return True
        return bool(self._matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return not self.waiting and bool(self._matcher.is_terminated())


class StructuredOutputCompiler:
    """Compiles constraints for one tokenizer and hands out matchers. Thread-safe: xgrammar's
    compiler is, and the lazy set-up is done under a lock."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                t0 = time.perf_counter()
                try:
                    import xgrammar
                except ImportError as exc:  # pragma: no cover - a declared dependency
                    raise InvalidRequestError("structured outputs need the xgrammar package "
                                              "(pip install xgrammar)", "structured_outputs") from exc
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info)
                logger.info("structured outputs: xgrammar ready for a vocabulary of %d in %.1fs",
                            self.vocab_size, time.perf_counter() - t0)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (xgrammar caches by text); a constraint that does not
        compile is an InvalidRequestError naming what is wrong with it."""
        compiler = self._xgrammar_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(spec.json),
                                                    any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:
            lines = str(exc).strip().splitlines() or ["(no message)"]
            message = _NATIVE_PREFIX.sub("", lines[0])
            raise InvalidRequestError(f"structured output: the {kind} constraint does not compile: {message}",
                                      "structured_outputs") from exc

    def matchers(self, spec: StructuredOutputsParams, n: int, prompt_ids: list[int] | None = None
                 ) -> list[GrammarMatcher]:
        """n fresh matchers of one constraint (one per sample of a request)."""
        import xgrammar

        compiled = self.compile(spec)
        end, waiting = None, False
        if spec.reasoning_markers is not None:
            start, end = (tuple(m) for m in spec.reasoning_markers)
            waiting = not closed_in(prompt_ids or [], start, end)
        return [GrammarMatcher(xgrammar.GrammarMatcher(compiled), end, waiting) for _ in range(n)]


def _last_index(ids: list[int], marker: tuple[int, ...]) -> int:
    for i in range(len(ids) - len(marker), -1, -1):
        if tuple(ids[i:i + len(marker)]) == marker:
            return i
    return -1


def closed_in(ids: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """The prompt's last thinking block is already closed (e.g. Qwen3's template with thinking
    off writes an empty one): the answer starts at once."""
    opened = _last_index(ids, start)
    return opened >= 0 and _last_index(ids[opened:], end) >= 0


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
