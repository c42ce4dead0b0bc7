"""The HTTP-level server settings (vLLM's flags): uvicorn options, CORS, access and request logs."""

from __future__ import annotations

import logging
from typing import Any

from engine.config.server_settings import ServerSettings
from engine.entrypoints.openai.http_protocol import http_protocol

request_logger = logging.getLogger("engine.entrypoints.openai.requests")
_LOGGED_BODY_CHARS = 2000


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """Keyword arguments for uvicorn.Config: kiln's HTTP/1.1 protocol (h11 with strict framing
    and timeouts, http_protocol.py) whatever parser is installed; kiln writes its own access
    log, so uvicorn's is off."""
    options: dict[str, Any] = dict(
        log_level=settings.uvicorn_log_level,
        access_log=False,
        http=http_protocol(settings),
        timeout_keep_alive=settings.http_idle_timeout_s,
    )
    if settings.root_path:
        options["root_path"] = settings.root_path
    # Proxy headers only from the proxies the operator names: uvicorn trusts 127.0.0.1 by default,
    # and a local client could then pose as any address (per-client fairness keys on it).
    if settings.forwarded_allow_ips:
        options.update(proxy_headers=True, forwarded_allow_ips=list(settings.forwarded_allow_ips))
    else:
        options["proxy_headers"] = False
    if settings.ssl_keyfile is not None:
        options.update(ssl_keyfile=str(settings.ssl_keyfile), ssl_certfile=str(settings.ssl_certfile))
        if settings.ssl_ca_certs is not None:
            options.update(ssl_ca_certs=str(settings.ssl_ca_certs), ssl_cert_reqs=settings.ssl_cert_reqs)
        if settings.ssl_ciphers:
            options["ssl_ciphers"] = settings.ssl_ciphers
    return options


def add_http_middleware(app, settings: ServerSettings) -> None:
    """CORS for --allowed-origins; the request log for --enable-log-requests; the access log off
    with --disable-uvicorn-access-log."""
    logging.getLogger("engine.entrypoints.openai.access").disabled = settings.disable_uvicorn_access_log
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_credentials=settings.allow_credentials,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
        )
    if settings.enable_log_requests:
        app.add_middleware(RequestLogMiddleware)


class RequestLogMiddleware:
    """Logs each API request's method, path and body (prompt and sampling parameters, truncated)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = [0]

        async def logging_receive():
            message = await receive()
            if message["type"] == "http.request":
                if size[0] < _LOGGED_BODY_CHARS:
                    chunks.append(message.get("body", b"")[:_LOGGED_BODY_CHARS])
                size[0] += len(message.get("body", b""))
                if not message.get("more_body"):
                    body = b"".join(chunks)[:_LOGGED_BODY_CHARS].decode("utf-8", "replace")
                    more = "..." if size[0] > _LOGGED_BODY_CHARS else ""
                    request_logger.info(
                        "request %s %s (%d bytes): %s%s", scope["method"], scope.get("path"), size[0], body, more
                    )
            return message

        await self.app(scope, logging_receive, send)
