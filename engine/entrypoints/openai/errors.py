"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status.

Every exception a request can raise maps to one status here; anything unexpected is a 500 that
names only the exception's type (no internals in messages).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.core.admission_rules import InvalidRequestError
from engine.entrypoints.openai.protocol import ErrorResponse
from engine.entrypoints.openai.request_body import BoundedJSONRoute
from engine.runtime.errors import EngineDeadError, QueueFullError
from engine.structured_output.compile_pool import CompileQueueFull
from engine.structured_output.grammars import CompileCancelled

logger = logging.getLogger("engine.entrypoints.openai")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class ClientGone(Exception):
    """The client disconnected while its request was being admitted (answered 499, to no one)."""


class RequestFailed(Exception):
    """The engine finished a request with an error (FinishReason.ERROR)."""


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": _encodable(message), "type": type_, "param": _encodable(param), "code": code}}


# Anthropic's routes answer errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
_ANTHROPIC_TYPES = {
    "server_error": "api_error",
    "service_unavailable": "overloaded_error",
    "timeout": "timeout_error",
    "request_too_large": "request_too_large",
}


def anthropic_error_body(openai_body: dict) -> dict:
    """An OpenAI error body (error_body) in Anthropic's shape (the param joins the message)."""
    err = openai_body["error"]
    kind = _ANTHROPIC_TYPES.get(err.get("code"), _ANTHROPIC_TYPES.get(err["type"], err["type"]))
    message = err["message"] if not err.get("param") else f"{err['param']}: {err['message']}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_route(scope) -> bool:
    return get_route_path(scope) in ANTHROPIC_ROUTES


def _encodable(text: str | None) -> str | None:
    """The text with anything UTF-8 cannot encode (a client's lone surrogate, echoed in a
    message) escaped: an error about bad Unicode must not itself fail to encode."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
    scope=None,
) -> JSONResponse:
    """The error as JSON: OpenAI's shape, or Anthropic's when `scope` is a request to its routes."""
    body = error_body(message, type_, param, code)
    if scope is not None and is_anthropic_route(scope):
        body = anthropic_error_body(body)
    return JSONResponse(body, status_code=status, headers=headers)


def timeout_error(timeout: float | None) -> APIError:
    return APIError(
        504, f"the request did not finish within request_timeout={timeout}s and was aborted", "timeout", None, "timeout"
    )


def engine_failed(detail: str) -> APIError:
    return APIError(500, f"the request failed in the engine: {detail}", "server_error", None, "engine_error")


def shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down; the request was not finished", "service_unavailable", None, "shutting_down"
    )


def stream_error_body(exc: BaseException, timeout: float | None) -> dict:
    """The SSE error event that ends a stream which could not finish."""
    if isinstance(exc, RequestFailed):
        return error_body(f"the request failed in the engine: {exc}", "server_error", None, "engine_error")
    if isinstance(exc, TimeoutError):
        err = timeout_error(timeout)
        return error_body(err.message, err.type, None, err.code)
    if isinstance(exc, APIError):
        return error_body(exc.message, exc.type, exc.param, exc.code)
    return error_body(str(exc), "service_unavailable", None, "engine_dead")


def _json_error_path(body: str, offset: int) -> str | None:
    """The field path (e.g. "messages[0].content") at character `offset` of a malformed JSON
    body: scans the prefix, keeping a stack of the object keys and array indices it is inside."""
    text = body[: max(offset, 0)]
    stack: list[Any] = []  # per open container: [key or None] for objects, [index] for arrays
    kinds: list[str] = []
    i, n, last_string = 0, len(text), None
    while i < n:
        ch = text[i]
        if ch == '"':
            j, buf = i + 1, []
            while j < n and text[j] != '"':
                if text[j] == "\\":
                    j += 1
                buf.append(text[j] if j < n else "")
                j += 1
            last_string = "".join(buf)
            i = j + 1
            continue
        if ch in "{[":
            kinds.append(ch)
            stack.append(None if ch == "{" else 0)
        elif ch in "}]" and kinds:
            kinds.pop()
            stack.pop()
        elif ch == ":" and kinds and kinds[-1] == "{":
            stack[-1] = last_string
        elif ch == "," and kinds:
            stack[-1] = None if kinds[-1] == "{" else stack[-1] + 1
        i += 1
    path = ""
    for kind, key in zip(kinds, stack):
        if kind == "[":
            path += f"[{key}]"
        elif key is not None:
            path += f".{key}" if path else str(key)
        else:
            break
    return path or None


async def validation_message(exc: RequestValidationError, request: Request) -> tuple[str, str | None]:
    parts, first = [], None
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            loc = err.get("loc", ())
            offset = loc[-1] if loc and isinstance(loc[-1], int) else 0
            body = exc.body if isinstance(exc.body, str) else (await request.body()).decode("utf-8", "replace")
            where = _json_error_path(body, offset)
            detail = (err.get("ctx") or {}).get("error") or "malformed JSON"
            line = body[:offset].count("\n") + 1
            parts.append(
                f"the request body is not valid JSON ({detail} at line {line}" + (f", in {where})" if where else ")")
            )
            first = first or where or "body"
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Drop pydantic's union-branch tags ("str", "list[int]") from the location.
        loc = [x for x in loc if not any(ch in x for ch in "[]") and x not in ("str", "int", "float", "bool")]
        field = ".".join(loc) or "body"
        first = first or field
        parts.append(f"{field}: {err.get('msg', 'invalid value')}")
    return "invalid request: " + "; ".join(dict.fromkeys(parts)), first


def post_route(router, path: str, body_type: type, handler, state) -> None:
    """POST `path`: the body parsed as `body_type`, then handler(state, body, request)."""

    async def endpoint(body, request: Request):
        return await handler(state, body, request)

    endpoint.__annotations__ = {"body": body_type, "request": Request}
    endpoint.__name__ = handler.__name__
    router.add_api_route(
        path, endpoint, methods=["POST"], responses=ERROR_RESPONSES, route_class_override=BoundedJSONRoute
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, scope=request.scope)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param, scope=request.scope)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = await validation_message(exc, request)
        return error_response(400, message, "invalid_request_error", param, scope=request.scope)

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, exc: QueueFullError):
        return error_response(503, str(exc), "service_unavailable", None, "overloaded", scope=request.scope)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "service_unavailable", None, "engine_dead", scope=request.scope)

    @app.exception_handler(CompileCancelled)
    async def _compile_stopped(request: Request, exc: CompileCancelled):
        return error_response(503, str(exc), "service_unavailable", None, "shutting_down", scope=request.scope)

    @app.exception_handler(CompileQueueFull)
    async def _compile_queue_full(request: Request, exc: CompileQueueFull):
        return error_response(
            429, str(exc), "rate_limit_error", "structured_outputs", "too_many_compiles", {"Retry-After": "1"}
        )

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)  # (gone while its body was being read)
    async def _gone(request: Request, exc: Exception):
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_, headers=exc.headers, scope=request.scope)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal server error: {type(exc).__name__}", "server_error", scope=request.scope)
