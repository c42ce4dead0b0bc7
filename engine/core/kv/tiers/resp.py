"""A minimal client of the Redis serialisation protocol (RESP2): enough for GET, SET, EXISTS, DEL
and PING against Redis or Valkey. kiln needs these few commands only, so it carries no client
library; one connection, one command at a time (callers share it under a lock), reconnected once
after a broken connection."""

from __future__ import annotations

import socket
import threading
from typing import Any
from urllib.parse import urlparse


class RespError(RuntimeError):
    """The server answered with an error, or the connection failed."""


def parse_url(url: str) -> tuple[str, int, int]:
    """redis://host:port/db (or valkey://) -> (host, port, db)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "valkey") or not parsed.hostname:
        raise ValueError(f"remote KV store {url!r}: expected redis://HOST:PORT[/DB]")
    db = int(parsed.path.strip("/") or 0)
    return parsed.hostname, parsed.port or 6379, db


class RespClient:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.host, self.port, self.db = parse_url(url)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._file: Any = None  # (the socket's buffered reader)
        self._lock = threading.Lock()

    def _connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._file = sock, sock.makefile("rb")
        if self.db:
            self._roundtrip((b"SELECT", str(self.db).encode()))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = self._file = None

    def command(self, *args: bytes | str | int):
        parts = tuple(a if isinstance(a, bytes) else str(a).encode() for a in args)
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                    return self._roundtrip(parts)
                except (OSError, EOFError) as exc:
                    self._close()
                    if attempt:
                        raise RespError(f"{self.host}:{self.port}: {exc}") from exc
        raise AssertionError("unreachable")

    def _roundtrip(self, parts: tuple[bytes, ...]):
        assert self._sock is not None
        out = [b"*%d\r\n" % len(parts)]
        for p in parts:
            out.append(b"$%d\r\n" % len(p))
            out.append(p)
            out.append(b"\r\n")
        self._sock.sendall(b"".join(out))
        return self._reply()

    def _reply(self):
        line = self._file.readline()
        if not line.endswith(b"\r\n"):
            raise EOFError("connection closed mid-reply")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self._file.read(n + 2)
            if len(data) != n + 2:
                raise EOFError("connection closed mid-reply")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RespError(f"unexpected reply {line[:40]!r}")
