"""ASGI middleware: request ids, the API key, the access log; the body-size limit and the
shutdown gate, both applied before a byte of the body is parsed.

The API key is default-deny: with --api-key set, every request needs it except those whose
route is on the public list (PUBLIC_ROUTES, plus /metrics with --public-metrics). The route is
judged by the path the app's own router matches on (the request path less --root-path), never by
a prefix of the raw path, so a root path, a proxy or a route added later cannot open a way round
the key: a path that matches no route needs the key too."""

from __future__ import annotations

import logging
import secrets
import time
import uuid

from starlette._utils import get_route_path
from starlette.exceptions import HTTPException

from engine.entrypoints.openai.errors import error_response

access_logger = logging.getLogger("engine.entrypoints.openai.access")

# The routes answered without the API key (the documented allow-list): the liveness probes, and
# the static chat page (chat_page.py: it holds nothing, and the API calls it makes carry the key).
PUBLIC_ROUTES = frozenset({"/health", "/ping", "/"})
METRICS_ROUTE = "/metrics"
# The routes still answered while the server drains for shutdown (they start no work).
DRAIN_SERVED_ROUTES = PUBLIC_ROUTES | {METRICS_ROUTE, "/version"}
CLOSE = {"connection": "close"}  # the server closes the connection after this answer


class RequestContextMiddleware:
    """X-Request-Id (echoed or generated), the API key check, one access-log line per request,
    and Retry-After on every 503 (overloaded, shutting down: load balancers and the openai
    client's retries read it)."""

    def __init__(self, app, api_key: str | None, public_routes: "PublicRoutes", retry_after_s: int = 1) -> None:
        self.app = app
        self.api_key = api_key
        self.public_routes = public_routes
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        rid = _clean_request_id(headers.get(b"x-request-id")) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        status = [0]

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = dict(message)
                extra = [(b"x-request-id", rid.encode())]
                if status[0] == 503 and not any(k.lower() == b"retry-after" for k, _ in message.get("headers", [])):
                    extra.append((b"retry-after", self.retry_after))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        path = scope.get("path", "")
        try:
            if self.api_key is not None and not self.public_routes.is_public(scope) and not self._authorized(headers):
                resp = error_response(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                    scope=scope,
                )
                await resp(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info(
                '%s "%s %s" %d %.1fms request_id=%s',
                client[0],
                scope.get("method"),
                path,
                status[0] or 499,
                1000 * (time.perf_counter() - t0),
                rid,
            )

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        token = presented_key(headers.get(b"authorization", b""), headers.get(b"x-api-key", b""))
        return secrets.compare_digest(token.encode("latin-1"), self.api_key.encode("utf-8"))


def presented_key(authorization: bytes, x_api_key: bytes) -> str:
    """The key a request presents: OpenAI's `Authorization: Bearer KEY`, else Anthropic's
    `x-api-key: KEY` ("" without either)."""
    auth = authorization.decode("latin-1")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else x_api_key.decode("latin-1")


class PublicRoutes:
    """Which requests are public. The public routes have fixed paths, so the router sends a request
    to one exactly when the path it routes on (Starlette's get_route_path: the request path less
    the root path, the very function its router matches with) equals that path."""

    def __init__(self, public_metrics: bool = False) -> None:
        self.paths = PUBLIC_ROUTES | ({METRICS_ROUTE} if public_metrics else frozenset())

    def is_public(self, scope) -> bool:
        return get_route_path(scope) in self.paths

    @staticmethod
    def serves_while_draining(scope) -> bool:
        return get_route_path(scope) in DRAIN_SERVED_ROUTES


def _clean_request_id(raw: bytes | None) -> str | None:
    if not raw:
        return None
    text = raw.decode("latin-1")[:128]
    return text if text.isprintable() and text.isascii() and text.strip() else None


class GateMiddleware:
    """While the server drains for shutdown, requests that could start work get a 503 at once. A body larger than
    max_request_body_mb gets a 413 with Connection: close: at once when Content-Length says so,
    else as soon as the bytes received pass the limit (the body is never buffered whole, never
    parsed). Before the 413 the rest of the body is read and dropped, so that a client still
    sending reads the answer rather than a reset connection: a declared one up to 8 times the
    limit (it is finite), one of unknown length (chunked) up to one limit more, so an endless
    body is cut there."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state
        self.limit = int(state.settings.max_request_body_mb * (1 << 20))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining and not PublicRoutes.serves_while_draining(scope):
            await error_response(
                503, "the server is shutting down", "service_unavailable", None, "shutting_down", scope=scope
            )(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            if int(length) <= 8 * self.limit:  # (a larger one is not read at all)
                await self._discard(receive, int(length))
            await self._too_large(scope)(scope, receive, send)
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if message.get("more_body", False):
                        await self._discard(receive, self.limit)
                    raise HTTPException(413, self._message(), headers=CLOSE)
            return message

        await self.app(scope, counted_receive, send)

    async def _discard(self, receive, budget: int) -> None:
        """Read and drop the rest of the body, at most `budget` bytes."""
        dropped = 0
        while dropped < budget:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _message(self) -> str:
        return f"the request body is larger than max_request_body_mb={self.state.settings.max_request_body_mb:g} MB"

    def _too_large(self, scope):
        return error_response(413, self._message(), "invalid_request_error", None, "request_too_large", CLOSE, scope)
