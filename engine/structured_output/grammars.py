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

import collections
import json
import logging
import threading
import time
import weakref
from typing import Any

import torch

from engine.core import admission_rules as rules
from engine.core.params import StructuredOutputsParams
from engine.structured_output.compile_pool import (
    CompileCancelled,
    CompileFailed,
    CompilePool,
    compile_with,
    native_message,
)

logger = logging.getLogger(__name__)


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
            self._recent = (self._recent + [token])[-len(self._end) :]
            self.waiting = tuple(self._recent) != self._end
            return True
        return bool(self._matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return not self.waiting and bool(self._matcher.is_terminated())


def _grammar_source(spec: StructuredOutputsParams) -> tuple[str, str, bool]:
    """(xgrammar entry point, its text, any_whitespace): the cache key and what a worker compiles."""
    kind = spec.kind
    if kind == "json":
        return "json", json.dumps(spec.json), not spec.disable_any_whitespace
    if kind == "json_object":
        return "json", '{"type": "object"}', not spec.disable_any_whitespace
    if kind == "regex":
        return "regex", spec.regex, False
    if kind == "choice":
        return "grammar", choice_grammar(spec.choice), False
    return "grammar", spec.grammar, False


class GrammarCache:
    """Compiled grammars by their source, bounded in entries and bytes (least recently used out
    first). An evicted grammar that a request still holds stays findable (a weak map) until the
    last holder lets go: bounding the cache never makes a live request compile again."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lru: collections.OrderedDict[tuple, tuple[Any, int]] = collections.OrderedDict()
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.num_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: tuple) -> Any:
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit[0]
            return self._held.get(key)

    def put(self, key: tuple, grammar: Any) -> None:
        size = int(grammar.memory_size_bytes) if hasattr(grammar, "memory_size_bytes") else 0
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._lru[key] = (grammar, size)
            self.num_bytes += size
            try:
                self._held[key] = grammar
            except TypeError:  # not weakly referenceable: the LRU alone holds it
                pass
            while self._lru and (len(self._lru) > self.max_entries or self.num_bytes > self.max_bytes):
                _, (_, evicted) = self._lru.popitem(last=False)
                self.num_bytes -= evicted


class StructuredOutputCompiler:
    """Compiles constraints for one tokenizer and hands out matchers. Thread-safe. Compiled
    grammars are kept in a bounded GrammarCache. Without a pool (offline use) compiles run
    inline; with one (`use_pool`, the server) they run in killable worker processes under a
    time limit."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        cache_entries: int = 256,
        cache_bytes: int = 256 << 20,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._info: Any = None
        self._lock = threading.Lock()
        self.cache = GrammarCache(cache_entries, cache_bytes)
        self._pool: CompilePool | None = None
        self._pool_args: tuple[int, float, int] | None = None
        self._closed = False  # close() ran: no pool starts again, and no compile runs unbounded here

    def configure(
        self,
        timeout_s: float | None = None,
        workers: int | None = None,
        cache_entries: int | None = None,
        cache_bytes: int | None = None,
        queue_per_client: int = 8,
    ) -> None:
        """Server settings: compiles go to `workers` processes, each stopped after `timeout_s`
        (the pool starts on the first constrained request), at most `queue_per_client` waiting
        per client address; the cache's bounds."""
        if cache_entries is not None:
            self.cache.max_entries = cache_entries
        if cache_bytes is not None:
            self.cache.max_bytes = cache_bytes
        if timeout_s is not None and workers:
            self._pool_args = (workers, timeout_s, queue_per_client)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                t0 = time.perf_counter()
                # kiln's fast form of a tokenizer hands xgrammar transformers' own, loaded first:
                # xgrammar imports transformers too, and two threads importing it at once fail.
                hf = getattr(self._tokenizer, "transformers_tokenizer", self._tokenizer)
                try:
                    import xgrammar
                except ImportError as exc:  # pragma: no cover - a declared dependency
                    raise rules.constraints_unavailable() from exc
                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(self._info, cache_enabled=False)
                logger.info(
                    "structured outputs: xgrammar ready for a vocabulary of %d in %.1fs",
                    self.vocab_size,
                    time.perf_counter() - t0,
                )
            return self._compiler

    def _compile_pool(self) -> CompilePool | None:
        """The pool (started on first use), None without one; CompileCancelled once closed."""
        if self._pool_args is None and not self._closed:
            return None
        if not self._closed:
            self._xgrammar_compiler()
        with self._lock:
            # Judged (again) under the lock: close() may have run while xgrammar loaded (a server
            # stopped as it starts), and then no pool may start.
            if self._closed:
                raise CompileCancelled("the server is stopping; the constraint was not compiled")
            if self._pool is None and self._pool_args is not None:
                workers, timeout_s, queue_per_client = self._pool_args
                self._pool = CompilePool(self._info.serialize_json(), workers, timeout_s, queue_per_client)
            return self._pool

    def start_pool(self) -> None:
        """Start the compile workers now (the server, at start-up) rather than on the first
        constrained request; nothing without a configured pool, or once closed (a server stopped
        while it starts)."""
        try:
            self._compile_pool()
        except CompileCancelled:
            pass

    def close(self) -> None:
        """Stop the compile workers (running compiles are killed); compiles asked for later
        raise CompileCancelled (waiting for a pool that starts still to finish)."""
        with self._lock:
            self._closed = self._closed or self._pool_args is not None  # (first: _compile_pool reads it second)
            pool, self._pool, self._pool_args = self._pool, None, None
        if pool is not None:
            pool.close()

    def _raise_failure(self, spec: StructuredOutputsParams, outcome: CompileFailed) -> None:
        """A worker's failed compile as the request's error."""
        if outcome.status == "timeout":
            raise rules.constraint_compile_timeout(spec.kind, self._pool_args[1] if self._pool_args else "?")
        if outcome.status == "stopped":
            raise CompileCancelled("the server is stopping; the constraint was not compiled")
        if outcome.status == "cancelled":
            raise rules.constraint_compile_cancelled()
        raise rules.constraint_does_not_compile(spec.kind, outcome)

    def _compile_here(self, spec: StructuredOutputsParams, source: tuple) -> Any:
        """Compile in this process (cached); the pool's workers have shown it finishes in time."""
        try:
            grammar = compile_with(self._xgrammar_compiler(), *source)
        except RuntimeError as exc:
            raise rules.constraint_does_not_compile(spec.kind, native_message(exc)) from exc
        self.cache.put(source, grammar)
        return grammar

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (cached); a constraint that does not compile is an
        InvalidRequestError naming what is wrong with it."""
        source = _grammar_source(spec)
        hit = self.cache.get(source)
        if hit is not None:
            return hit
        pool = self._compile_pool()
        if pool is not None:
            try:
                pool.submit(source).future.result()
            except CompileFailed as exc:
                self._raise_failure(spec, exc)
        return self._compile_here(spec, source)

    async def compile_async(self, spec: StructuredOutputsParams, tenant: tuple[str, str] = ("", "")) -> Any:
        """compile() for the server: off the event loop, in the pool when there is one (first
        time-limited in a worker, then here); if the awaiting task is cancelled while a worker
        compiles (its client left, the server stops) the compile is stopped. `tenant`: (the
        client's address, its `user`), for the pool's fair shares."""
        import asyncio

        source = _grammar_source(spec)
        hit = self.cache.get(source)
        if hit is not None:
            return hit
        pool = await asyncio.to_thread(self._compile_pool)
        if pool is None:
            return await asyncio.to_thread(self.compile, spec)
        job = pool.submit(source, tenant)
        try:
            await asyncio.wrap_future(job.future)
        except CompileFailed as exc:
            self._raise_failure(spec, exc)
        except asyncio.CancelledError:
            job.cancelled.set()
            job.future.cancel()
            raise
        return await asyncio.to_thread(self._compile_here, spec, source)

    def matchers(
        self, compiled: Any, spec: StructuredOutputsParams, n: int, prompt_ids: list[int] | None = None
    ) -> list[GrammarMatcher]:
        """n fresh matchers of one compiled constraint (`compile`'s result for `spec`), one per
        sample of a request."""
        import xgrammar

        end, waiting = None, False
        if spec.reasoning_markers is not None:
            start, end = (tuple(m) for m in spec.reasoning_markers)
            waiting = not closed_in(prompt_ids or [], start, end)
        return [GrammarMatcher(xgrammar.GrammarMatcher(compiled), end, waiting) for _ in range(n)]


def _last_index(ids: list[int], marker: tuple[int, ...]) -> int:
    for i in range(len(ids) - len(marker), -1, -1):
        if tuple(ids[i : i + len(marker)]) == marker:
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
