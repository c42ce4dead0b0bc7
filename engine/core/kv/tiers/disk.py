"""The disk tier: a directory of content-addressed block records, shared by every process of one
model on the host.

Layout: <root>/<model fingerprint>/<key>.kvb, one record (block_record.py) per file. A record is
written to a temporary file in the same directory and renamed into place, so a reader sees a whole
file or none (several replicas may write the same key at once: the last rename wins, and both
wrote the same bytes). The index (key -> size, least recently used first) is rebuilt from a scan
at start; a key missing from it is looked for on disk too, so one replica finds what another wrote
since. Reading a record touches its mtime, which orders the scan of the next process (LRU across
restarts). Past the capacity the least recently used files are deleted.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from engine.core.kv.tiers.base import TierStats

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 600.0  # a temporary file older than this is a dead writer's: removed at start


class DiskTier:
    name = "disk"
    local = True

    def __init__(self, root: Path, namespace: str, capacity_bytes: int, size_range: tuple[int, int]) -> None:
        """namespace: the model fingerprint (hex); size_range: the sizes a whole record can have
        (a file outside it is a partial write and is skipped at start)."""
        if capacity_bytes <= 0:
            raise ValueError("the disk KV tier needs a positive capacity")
        self.dir = Path(root).expanduser() / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.size_range = size_range
        self.stats = TierStats()
        self.num_bytes = 0
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._lock = threading.Lock()
        self._tmp_names = itertools.count()
        self.rebuild()

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: str) -> Path:
        return self.dir / (key + SUFFIX)

    def rebuild(self) -> None:
        """Index the directory (sizes and mtimes only: no record is read)."""
        t0 = time.perf_counter()
        found: list[tuple[int, str, int]] = []
        skipped = 0
        lo, hi = self.size_range
        now = time.time()
        with os.scandir(self.dir) as entries:
            for entry in entries:
                name = entry.name
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # (another process removed it meanwhile)
                if name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        _unlink(Path(entry.path))
                        skipped += 1
                    continue
                if not name.endswith(SUFFIX):
                    continue
                if not lo <= st.st_size <= hi:
                    _unlink(Path(entry.path))
                    skipped += 1
                    continue
                found.append((st.st_mtime_ns, name[: -len(SUFFIX)], st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self.num_bytes = sum(size for _, _, size in found)
        logger.info(
            "KV disk tier %s: %d blocks (%.2f GB of %.2f) indexed in %.2f s%s",
            self.dir,
            len(found),
            self.num_bytes / 1e9,
            self.capacity_bytes / 1e9,
            time.perf_counter() - t0,
            f"; {skipped} partial files skipped and removed" if skipped else "",
        )
        self._evict()

    def contains(self, key: str) -> bool:
        if key in self._index:
            return True
        try:
            size = self._path(key).stat().st_size  # (another replica's write since our scan)
        except FileNotFoundError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.num_bytes += size
        return True

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            record = path.read_bytes()
        except FileNotFoundError:
            self._drop(key)
            return None
        try:
            os.utime(path)  # (LRU order for the next process's scan)
        except OSError:
            pass
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return record

    def put(self, key: str, record: bytes) -> None:
        if key in self._index or len(record) > self.capacity_bytes:
            return
        tmp = self.dir / f".{key}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_names)}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(record)
            os.replace(tmp, self._path(key))
        except BaseException:
            _unlink(tmp)
            raise
        with self._lock:
            if key not in self._index:
                self._index[key] = len(record)
                self.num_bytes += len(record)
        self.stats.bytes_out += len(record)
        self._evict()

    def _evict(self) -> None:
        while self.num_bytes > self.capacity_bytes:
            with self._lock:
                if not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self.num_bytes -= size
            _unlink(self._path(key))
            self.stats.evictions += 1

    def _drop(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.num_bytes -= size

    def discard(self, key: str) -> None:
        """A record that failed its check: gone from the index and the directory."""
        self._drop(key)
        _unlink(self._path(key))

    def close(self) -> None:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
