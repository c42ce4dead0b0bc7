"""ServerState: everything one app serves from (the AsyncEngine, metrics, settings, the
tokenising threads, the live jobs). Nothing is module-level: two apps in one process share nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

from engine.config.server_settings import ServerSettings
from engine.config.settings import EngineSettings
from engine.core.params import LoRARequest
from engine.entrypoints.openai.metrics import EngineMetrics
from engine.entrypoints.openai.response_store import ResponseStore
from engine.runtime.admission import Admission
from engine.runtime.async_engine import AsyncEngine
from engine.runtime.engine_info import EngineInfo

logger = logging.getLogger("engine.entrypoints.openai")


def kiln_version() -> str:
    try:
        return metadata.version("kiln-serve")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0+unknown"


class JobRegistry(set):
    """The live jobs (engine/entrypoints/openai/jobs.py); once closed (shutdown) no new job starts."""

    closed = False


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: EngineMetrics
    settings: ServerSettings
    model_name: str
    model_root: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    jobs: "JobRegistry" = dataclasses.field(default_factory=lambda: JobRegistry())  # live jobs, for shutdown
    draining: bool = False  # shutting down: new requests get a 503
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # the Responses API's `store`
    _pools: dict[str, concurrent.futures.ThreadPoolExecutor] = dataclasses.field(default_factory=dict)

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def tokenizer(self):
        return self.engine.info.tokenizer

    @property
    def admission(self) -> Admission:
        """The engine's admission step (engine/runtime/admission.py): its rules, checked once per request."""
        return self.engine.admission

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token covers (bounds a text's token count from below)."""
        from engine.entrypoints.openai.admission import max_token_chars

        return max_token_chars(self.tokenizer)

    def adapters(self) -> list[LoRARequest]:
        return self.engine.lora_adapters()

    async def off_loop(self, fn: Callable[..., Any], *args: Any, size: int = 0) -> Any:
        """fn(*args) on the tokenising threads: tokenisation and chat templates never run on the
        event loop (a long prompt would stall every stream) nor on the engine's step thread.
        A job of `size` >= tokenizer_large_job_chars (characters, or token ids) runs on its own
        lane (tokenizer_large_job_threads), so a pile of long texts never delays a short one."""
        large = size >= self.settings.tokenizer_large_job_chars
        return await asyncio.get_running_loop().run_in_executor(self._pool("large" if large else "small"), fn, *args)

    async def parse_off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the JSON thread: large request bodies parse there (request_body.py), one
        at a time, so four floods take one thread's share of the CPU, not four."""
        return await asyncio.get_running_loop().run_in_executor(self._pool("json"), fn, *args)

    def _pool(self, lane: str) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._pools.get(lane)
        if pool is None:
            threads = {"large": self.settings.tokenizer_large_job_threads, "json": 1}.get(
                lane, self.settings.tokenizer_threads
            )
            pool = self._pools[lane] = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix="kiln-json" if lane == "json" else f"kiln-tokenize-{lane}"
            )
        return pool

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, give the running ones `timeout` seconds, then end the rest (a
        stream with an error event and [DONE], a plain request with a JSON 503)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.jobs:
            logger.warning("shutdown: ending %d unfinished requests after %.0fs", len(self.jobs), timeout)
        self.jobs.closed = True
        for job in list(self.jobs):
            job.end()
        # Compiles still running end now (a 503 each); off the loop: closing waits for the
        # compiler's lock, which its start-up holds for seconds (xgrammar loading).
        await asyncio.to_thread(self.engine.grammar_compiler.close)
        deadline = time.monotonic() + 5.0
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self.engine.grammar_compiler.close()


def default_model_name(engine_settings: EngineSettings, model_dir) -> str:
    return engine_settings.model or str(model_dir)


def create_state(engine_settings: EngineSettings, server_settings: ServerSettings | None = None) -> ServerState:
    """Build the engine (slow: loads the model) and everything the app needs; the loop is not started."""
    from engine.runtime.llm_engine import LLMEngine

    server_settings = server_settings or ServerSettings()
    llm_engine = LLMEngine.from_settings(engine_settings)
    if server_settings.warm_prefixes is not None:
        from engine.runtime.warm_prefixes import warm_up_from_file

        pinned = warm_up_from_file(llm_engine, server_settings.warm_prefixes)
        logger.info("warm prefixes from %s: %d KV blocks pinned", server_settings.warm_prefixes, pinned)
    name = (server_settings.model_names or [None])[0] or default_model_name(engine_settings, llm_engine.model_dir)
    metrics = EngineMetrics(name, engine_settings.log_stats_interval)
    metrics.set_engine_info(llm_engine)
    engine = AsyncEngine(
        llm_engine,
        listener=metrics,
        stream_stall_timeout_s=server_settings.stream_stall_timeout_s or None,  # (0: never)
        stream_pause_tokens=server_settings.stream_pause_tokens or None,
    )
    engine.grammar_compiler.configure(
        timeout_s=server_settings.grammar_compile_timeout_s,
        workers=server_settings.grammar_compile_workers,
        cache_entries=server_settings.grammar_cache_entries,
        cache_bytes=int(server_settings.grammar_cache_mb * (1 << 20)),
        queue_per_client=server_settings.grammar_compile_queue_per_client,
    )
    store = ResponseStore(
        server_settings.response_store_entries,
        int(server_settings.response_store_mb * (1 << 20)),
        server_settings.response_store_max_age_s,
    )
    return ServerState(engine, metrics, server_settings, name, engine.info.model_dir, responses=store)
