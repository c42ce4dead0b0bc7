"""The KV tiers wired to the engine core: prefix blocks go down when they turn idle, and come
back by a load at admission.

Down: the block pool logs each hashed block that turns cached-idle (a finished or preempted
request's full blocks); before the next launch can overwrite any of them (`drain_saves`, called
before installing loads and again after scheduling), their bytes are copied out of the KV cache
and queued to the store's writer thread. A block this process already stored or loaded is skipped.

Up: at admission (`hold`), a request whose prompt continues past the pool's prefix hits into
blocks a tier holds (any block, when a remote tier is set: asking it is a round trip) is added
to the scheduler *held*, and its blocks are read on the loader thread, verified, while other
requests' steps run. At the start of a later step (`install_ready`) the payloads are written
into free pool blocks, registered under their digests as cached-idle blocks, and the request is
queued: its admission takes them as ordinary prefix hits. Whatever is not loaded (a miss, a
corrupt record, an error, a pool with no room) is prefilled as usual.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.core.kv.block_pool import BlockPool, chain_digest
from engine.core.kv.tiers.store import BlockRef, TierStore
from engine.core.request import Request
from engine.core.request_kinds import task_of
from engine.core.sched.scheduler import Scheduler
from engine.worker.kv_block_io import KVBlockIO

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    request: Request
    blocks: list[BlockRef]
    future: Future
    t0: float


@dataclass
class TierCounters:
    requests_held: int = 0  # requests that waited for a load
    blocks_loaded: int = 0  # blocks installed into the pool from a tier
    blocks_saved: int = 0  # blocks queued to the tiers
    load_wait_seconds: float = 0.0  # admission to install, summed over held requests
    blocks_dropped_no_room: int = 0  # loaded but not installed: the pool had no room
    load_errors: int = 0


class KVTiers:
    def __init__(self, store: TierStore, io: KVBlockIO, pool: BlockPool, scheduler: Scheduler) -> None:
        if io.bytes_per_block != store.payload_bytes:
            raise ValueError("KV tiers: the store's block size differs from the cache's")
        self.store = store
        self.io = io
        self.pool = pool
        self.scheduler = scheduler
        self.counters = TierCounters()
        pool.idle_log = []
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kiln-kv-tier-loader")
        self._loads: dict[str, _Load] = {}
        self._closed = False

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    @property
    def num_loading(self) -> int:
        """Requests held for their loads."""
        return len(self._loads)

    # ---- up: admission ----
    def hold(self, request: Request) -> bool:
        """Start loading the prompt's blocks past the pool's hits that the tiers hold; True if the
        request must be added held (the scheduler queues it once `install_ready` is done with it)."""
        pool = self.pool
        if not pool.enable_prefix_caching or not task_of(request).prefix_cacheable:
            return False
        self.drain_saves()  # (blocks that just turned idle are findable from now on)
        bs = pool.block_size
        tokens = request.prompt_token_ids
        max_blocks = (len(tokens) - 1) // bs  # (one token is always computed, for its logits)
        root = request.prefix_root
        hits, digests = pool.match_prefix(tokens, max_blocks, root)
        if len(hits) >= max_blocks:
            return False
        parent = digests[-1] if digests else root
        refs: list[BlockRef] = []
        for i in range(len(hits), max_blocks):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            digest = chain_digest(parent, toks)
            refs.append(BlockRef(digest, parent, toks))
            parent = digest
        if not self.store.has_remote and not self.store.held_locally(refs[0].digest):
            return False
        self._loads[request.request_id] = _Load(
            request, refs, self._loader.submit(self.store.read_run, refs), time.perf_counter()
        )
        self.counters.requests_held += 1
        return True

    def install_ready(self, wait: bool = False) -> None:
        """Install every finished load and queue its request; `wait`: nothing else can run, so
        wait for the oldest load rather than spin."""
        if not self._loads:
            return
        if wait:
            next(iter(self._loads.values())).future.exception()  # (blocks until it is done)
        for request_id, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[request_id]
            try:
                payloads = load.future.result()
            except Exception as exc:
                self.counters.load_errors += 1
                logger.warning("KV tiers: loading a prefix failed (%s): it is prefilled", exc)
                payloads = []  # (an empty run)
            self._install(load.request, load.blocks[: len(payloads)], payloads)
            self.counters.load_wait_seconds += time.perf_counter() - load.t0
            self.scheduler.release_held(load.request)

    def _install(self, request: Request, blocks: list[BlockRef], payloads: list[bytes | memoryview]) -> None:
        pool = self.pool
        if not payloads:
            return
        # The prompt's blocks already in the pool are held while the loaded ones take room, so
        # that room is not theirs (an allocation evicts the least recently used idle block).
        tokens = request.prompt_token_ids
        hits, _ = pool.match_prefix(tokens, len(tokens) // pool.block_size, request.prefix_root)
        for block in hits:
            pool.incref(block)
        ids: list[int] = []
        try:
            room = min(len(payloads), pool.num_available)
            self.counters.blocks_dropped_no_room += len(payloads) - room
            ids = pool.allocate_many(room)
            self.io.write(ids, payloads[:room])
            for block_id, ref in zip(ids, blocks):
                pool.cache_block(block_id, ref.parent, list(ref.tokens))
            self.counters.blocks_loaded += room
        finally:
            # Idle now, the prompt's first blocks most recently used (as a finished request leaves
            # them); a loaded block whose digest was registered meanwhile goes back to the free list.
            pool.free_all(ids)
            pool.free_all(hits)

    # ---- down: blocks turning idle ----
    def drain_saves(self) -> None:
        """Copy out the blocks that turned idle since the last call and queue them to the tiers."""
        log = self.pool.idle_log
        if not log:
            return
        self.pool.idle_log = []
        todo: dict[bytes, tuple[int, BlockRef]] = {}
        for block_id, digest, parent, tokens in log:
            if digest not in todo and not self.store.knows(digest):
                todo[digest] = (block_id, BlockRef(digest, parent, tokens))
        if not todo:
            return
        items = list(todo.values())
        payloads = self.io.read([block_id for block_id, _ in items])
        for (_, ref), payload in zip(items, payloads):
            if self.store.save(ref, payload):
                self.counters.blocks_saved += 1

    # ---- lifetime ----
    def cancel_all(self) -> None:
        """Forget every load (the engine failed its requests); their reads finish unused."""
        self._loads.clear()

    def flush(self) -> None:
        """Queue what turned idle and wait until the tiers have it (tests, shutdown)."""
        self.drain_saves()
        self.store.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._loader.shutdown(wait=True)
        self.store.close()
