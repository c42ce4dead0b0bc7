"""kiln's HTTP/1.1 connection: uvicorn's h11 protocol with strict message framing and timeouts.

uvicorn picks httptools when it is installed and h11 otherwise; kiln always runs this h11
subclass, so the checks below hold whatever is installed:

- Framing (RFC 9112): a request head with both Content-Length and Transfer-Encoding, more than
  one Content-Length (or a list of them), more than one Transfer-Encoding or Host, Transfer-
  Encoding in an HTTP/1.0 request, an obsolete line fold, a line (the head's closing empty line
  too) not ended by CRLF, or a request that is not HTTP/1.x (an HTTP/2 preface: this port
  speaks HTTP/1.1 only) is a 400 and the connection is closed before the request reaches the
  app (so nothing smuggled behind it is read). h11 rejects the rest (bad chunk sizes, bad header lines) and
  the connection is
  closed the same way.
- Timeouts: a new connection must send its request head within `http_header_timeout_s`; a
  kept-alive connection with no request in progress closes after `http_idle_timeout_s` (longer
  than common clients' keep-alive, so a client never reuses a connection the server is closing);
  a request head not complete within `http_header_timeout_s` of its first byte gets a 408; a body that stalls for
  `http_body_timeout_s`, or is not complete within `http_body_deadline_s` of its head (a body
  trickled a byte at a time never stalls), gets a 408; a response the client does not read for
  `stream_stall_timeout_s` (the write buffer stays full) is cut off. Each 4xx here closes the
  connection.
- A connection cap: at most `http_max_connections` open; a new connection beyond it closes the
  connection that has been idle (kept alive, no request begun) longest, or, when none is idle,
  its request gets a 503 and it is closed. A flood of idle connections cannot keep new clients out, and the
  long idle timeout costs no protection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from dataclasses import dataclass

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.config.server_settings import ServerSettings

logger = logging.getLogger("engine.entrypoints.openai")

_HEAD_END = re.compile(rb"\n\r?\n")
_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


@dataclass(frozen=True)
class HTTPLimits:
    idle_s: float
    header_s: float
    body_s: float
    body_deadline_s: float
    write_stall_s: float | None
    drain_bytes: int  # after an answer given before the body was read: at most this much more is read
    send_buffer: int | None  # SO_SNDBUF (bytes)
    max_connections: int
    retry_after_s: int  # the Retry-After of the cap's 503 (as every 503's)

    @classmethod
    def of(cls, settings: ServerSettings) -> "HTTPLimits":
        return cls(
            settings.http_idle_timeout_s,
            settings.http_header_timeout_s,
            settings.http_body_timeout_s,
            settings.http_body_deadline_s,
            settings.stream_stall_timeout_s or None,
            int(settings.max_request_body_mb * (1 << 20)),
            (settings.http_send_buffer_kb << 10) or None,
            settings.http_max_connections,
            settings.retry_after_s,
        )


def framing_problem(buffered: bytes) -> str | None:
    """What makes the request head at the start of `buffered` ambiguous to frame (None when it
    is fine, or not complete yet)."""
    end = _HEAD_END.search(buffered)
    if end is None:
        return None
    lines = buffered[: end.start() + 1].split(b"\n")[:-1]
    while lines and lines[0] in (b"", b"\r"):  # empty lines before the request line (RFC 9112 2.2)
        lines.pop(0)
    if not lines:
        return None  # (h11 refuses a head without a request line)
    if lines[0].startswith(b"PRI * HTTP/2"):
        return "an HTTP/2 connection preface (this port speaks HTTP/1.1 only)"
    if not lines[0].rstrip(b"\r").endswith((b" HTTP/1.1", b" HTTP/1.0")):
        return "not an HTTP/1.0 or HTTP/1.1 request line"
    if end.group() != b"\n\r\n":
        return "the head's closing empty line ends without CRLF"
    counts = {b"content-length": 0, b"transfer-encoding": 0, b"host": 0}
    for i, line in enumerate(lines):
        if not line.endswith(b"\r"):
            return "a header line ends without CRLF"
        line = line[:-1]
        if b"\r" in line:
            return "a header line holds a bare CR"
        if i == 0:
            continue
        if line[:1] in (b" ", b"\t"):
            return "a header is folded over several lines (obs-fold)"
        name, _, value = line.partition(b":")
        name = name.lower()
        if name in counts:
            counts[name] += 1
            if name == b"content-length" and b"," in value:
                return "more than one Content-Length"
    if counts[b"content-length"] and counts[b"transfer-encoding"]:
        return "both Content-Length and Transfer-Encoding"
    if counts[b"content-length"] > 1:
        return "more than one Content-Length"
    if counts[b"transfer-encoding"] > 1:
        return "more than one Transfer-Encoding"
    if counts[b"host"] > 1:
        return "more than one Host"
    if counts[b"transfer-encoding"] and lines[0].rstrip(b"\r").endswith(b"HTTP/1.0"):
        return "Transfer-Encoding in an HTTP/1.0 request"
    return None


class _FramingChecked(h11.Connection):
    """h11 with kiln's framing check on each request head before h11 reads it, and a hook on
    every event (the protocol's timers follow the request through it)."""

    def __init__(self, protocol: "KilnHTTPProtocol", max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._protocol = protocol

    def next_event(self):
        if self.their_state is h11.IDLE:
            problem = framing_problem(self.trailing_data[0])
            if problem is not None:
                self._protocol.framing_error = problem
                raise h11.RemoteProtocolError(problem, error_status_hint=400)
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self._protocol.protocol_error = str(exc)
            raise
        self._protocol.on_event(event)
        return event


class KilnHTTPProtocol(H11Protocol):
    """See the module docstring; `limits` is set by `http_protocol(settings)`."""

    limits: HTTPLimits

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _FramingChecked(self, config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.framing_error: str | None = None  # kiln's framing check refused the request head
        self.protocol_error: str | None = None  # h11 refused the request
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._drained = 0  # body bytes read and dropped after the answer
        self._head_on_first_byte = False  # kept alive after a response: the head timer starts with the next byte
        self.idle_since: float | None = None  # (loop time) open with no request begun: the cap may close it
        self._over_cap = False  # opened over the cap with no connection idle: its request gets a 503

    # ---- connection life ----
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.limits.send_buffer is not None and sock is not None:
            # A fixed send buffer: what a client that does not read holds stays small, and the
            # back-pressure reaches the app (autotuning would let the kernel take megabytes).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer)
        self._await_request()
        # uvicorn arms its keep-alive (idle) timer only after a response: a fresh connection gets one too.
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.idle_s, self.timeout_keep_alive_handler)
        self.idle_since = self.loop.time()
        if len(self.server_state.connections) > self.limits.max_connections:
            self._make_room()

    def _make_room(self) -> None:
        """Over the cap: close the longest-idle other connection, or refuse this one."""
        idle = [
            c for c in self.server_state.connections if c is not self and getattr(c, "idle_since", None) is not None
        ]
        if idle:
            oldest = min(idle, key=lambda c: c.idle_since)
            oldest.idle_since = None
            oldest.transport.close()
            return
        # Answered once its request arrives: a 503 written at once would be lost to the reset its
        # request then meets (data sent to a closed socket).
        self._over_cap = True

    def connection_lost(self, exc) -> None:
        self.idle_since = None
        for name in ("_head_timer", "_body_timer", "_body_deadline", "_write_timer"):
            self._cancel(name)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            if self.conn.trailing_data[0]:
                self._await_request()  # (a pipelined request: before uvicorn reads it, which disarms this)
            else:
                self._head_on_first_byte = True  # idle until then: uvicorn's keep-alive timer (idle_s)
                self.idle_since = self.loop.time()
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        if data:
            self.idle_since = None
        if self._over_cap:
            self._over_cap = False
            logger.info(
                "%s: http_max_connections=%d reached, none idle: 503", _peer(self.client), self.limits.max_connections
            )
            self._reject(
                503,
                f"the server has http_max_connections={self.limits.max_connections} connections open; retry later",
                "too_many_connections",
            )
            return
        if self._head_on_first_byte and data:
            self._head_on_first_byte = False
            self._await_request()
        super().data_received(data)

    def _await_request(self) -> None:
        self._arm("_head_timer", self.limits.header_s, self._head_timed_out)

    # ---- events (from _FramingChecked) ----
    def on_event(self, event) -> None:
        if isinstance(event, h11.Request):
            self._cancel("_head_timer")
            self._head_on_first_byte = False
            self._drained = 0
            if self.conn.their_state is h11.SEND_BODY:
                self._arm("_body_timer", self.limits.body_s, self._body_timed_out)
                self._arm("_body_deadline", self.limits.body_deadline_s, self._body_too_slow)
        elif isinstance(event, h11.Data):
            self._arm("_body_timer", self.limits.body_s, self._body_timed_out)
            if self.conn.our_state is not h11.SEND_RESPONSE and self.conn.our_state is not h11.SEND_BODY:
                # Answered already (uvicorn reads the rest and drops it): not without end.
                self._drained += len(event.data)
                if self._drained > self.limits.drain_bytes:
                    self.transport.close()
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            self._cancel("_body_timer")
            self._cancel("_body_deadline")

    # ---- timeouts ----
    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            self._reject(408, f"the request head did not arrive within http_header_timeout_s={self.limits.header_s:g}s")
        else:
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.cycle is None or self.cycle.response_complete:  # answered already: nothing left to say
            self.transport.close()
            return
        if self.flow.read_paused:  # the app has not read what came: not the client's stall
            self._arm("_body_timer", self.limits.body_s, self._body_timed_out)
            return
        self._reject(408, f"the request body stalled for http_body_timeout_s={self.limits.body_s:g}s")

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
            return
        self._reject(
            408, f"the request body did not arrive within http_body_deadline_s={self.limits.body_deadline_s:g}s"
        )

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.limits.write_stall_s is not None:
            self._arm("_write_timer", self.limits.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel("_write_timer")
        super().resume_writing()

    def _write_stalled(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            logger.info(
                "%s: the client read nothing for stream_stall_timeout_s=%gs; closing its connection",
                _peer(self.client),
                self.limits.write_stall_s,
            )
            self.transport.abort()

    # ---- refusing ----
    def send_400_response(self, msg: str) -> None:
        """(uvicorn calls this when h11 refuses the request; kiln's framing check raises there too)"""
        if self.framing_error is not None:
            problem, code = f"ambiguous request framing: {self.framing_error}", "invalid_framing"
        else:
            problem, code = f"not a valid HTTP request: {(self.protocol_error or msg)[:200]}", "invalid_http"
        logger.info("%s: %s; closing the connection", _peer(self.client), problem)
        self._reject(400, problem, code)

    def _reject(self, status: int, message: str, code: str = "request_timeout") -> None:
        """A JSON error and Connection: close, written directly (h11's state may not allow a
        response); the app, if it runs, sees the client as gone."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # too late for a status line: only close
                self.transport.close()
                return
        type_ = {408: "timeout", 503: "service_unavailable"}.get(status, "invalid_request_error")
        body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
        retry = f"retry-after: {self.limits.retry_after_s}\r\n" if status == 503 else ""
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n{retry}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()

    # ---- timers ----
    def _arm(self, name: str, seconds: float, callback) -> None:
        self._cancel(name)
        setattr(self, name, self.loop.call_later(seconds, callback))

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"


def http_protocol(settings: ServerSettings) -> type[KilnHTTPProtocol]:
    """The protocol class for uvicorn.Config(http=...) under these settings."""
    return type("KilnHTTP", (KilnHTTPProtocol,), {"limits": HTTPLimits.of(settings)})
