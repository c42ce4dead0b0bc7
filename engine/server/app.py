"""The FastAPI app: OpenAI-compatible completions and chat, plus health, metrics, tokenize.

`build_app(state)` wires routes to one `ServerState` (the AsyncEngine, its metrics, the
settings); `create_state(engine_settings, server_settings)` builds that state. Nothing
here is module-level state: two apps in one process do not share anything.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from engine.config import EngineSettings, ServerSettings
from engine.generation_config import apply_generation_defaults
from engine.request import InvalidRequestError, LoRARequest, PoolingParams, RequestOutput, SamplingParams
from engine.server.metrics import CONTENT_TYPE, EngineMetrics
from engine.server.reasoning import ReasoningParser
from engine.server.tool_calls import ToolCall, ToolMode
from engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                    ErrorResponse, LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)

logger = logging.getLogger("engine.server")
access_logger = logging.getLogger("engine.server.access")

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


def kiln_version() -> str:
    try:
        return metadata.version("kiln-serve")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0+unknown"


# ---------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | int | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Drop pydantic's union-branch tags ("str", "list[int]") from the location.
        loc = [x for x in loc if not any(ch in x for ch in "[]") and x not in ("str", "int", "float", "bool")]
        field = ".".join(loc) or "body"
        first = first or field
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON")
        else:
            parts.append(f"{field}: {msg}")
    return "invalid request: " + "; ".join(dict.fromkeys(parts)), first


# ---------------------------------------------------------------- state
@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: EngineMetrics
    settings: ServerSettings
    model_name: str
    model_root: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def adapters(self) -> list[LoRARequest]:
        lora = self.engine.engine.lora
        return lora.adapters if lora is not None else []


def default_model_name(engine_settings: EngineSettings, model_dir) -> str:
    return engine_settings.model or str(model_dir)


def create_state(engine_settings: EngineSettings, server_settings: ServerSettings | None = None) -> ServerState:
    """Build the engine (slow: loads the model) and everything the app needs; the loop is not started."""
    from engine.llm_engine import LLMEngine

    server_settings = server_settings or ServerSettings()
    llm_engine = LLMEngine(engine_settings)
    if server_settings.warm_prefixes is not None:
        from engine.warm_prefixes import warm_up_from_file

        pinned = warm_up_from_file(llm_engine, server_settings.warm_prefixes)
        logger.info("warm prefixes from %s: %d KV blocks pinned", server_settings.warm_prefixes, pinned)
    name = (server_settings.model_names or [None])[0] or default_model_name(engine_settings, llm_engine.model_dir)
    metrics = EngineMetrics(name, engine_settings.log_stats_interval)
    metrics.set_engine_info(llm_engine)
    engine = AsyncEngine(llm_engine, listener=metrics)
    return ServerState(engine, metrics, server_settings, name, str(llm_engine.model_dir))


# ---------------------------------------------------------------- middleware
class RequestContextMiddleware:
    """X-Request-Id (echoed or generated), the API key check, and one access-log line per request."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

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
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        path = scope.get("path", "")
        try:
            if self.api_key is not None and path.startswith(PROTECTED_PREFIXES) \
                    and not self._authorized(headers):
                resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                      "authentication_error", None, "invalid_api_key")
                await resp(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info('%s "%s %s" %d %.1fms request_id=%s', client[0], scope.get("method"), path,
                               status[0] or 499, 1000 * (time.perf_counter() - t0), rid)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode(
            "latin-1")
        return secrets.compare_digest(token.encode("latin-1"), self.api_key.encode("utf-8"))


def _clean_request_id(raw: bytes | None) -> str | None:
    if not raw:
        return None
    text = raw.decode("latin-1")[:128]
    return text if text.isprintable() and text.isascii() and text.strip() else None


# ---------------------------------------------------------------- the app
def build_app(state: ServerState, manage_engine: bool = True) -> FastAPI:
    """The app over `state`. With manage_engine, the app's lifespan starts and stops the engine loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            state.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                state.engine.shutdown()

    app = FastAPI(title="kiln", version=kiln_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions and chat served by kiln")
    app.state.kiln = state
    app.add_middleware(RequestContextMiddleware, api_key=state.settings.api_key)
    _install_error_handlers(app)
    handlers = _Handlers(state)

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def create_completion(body: CompletionRequest, request: Request):
        return await handlers.completion(body, request)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await handlers.chat(body, request)

    @app.post("/v1/embeddings", responses=_ERROR_RESPONSES)
    async def create_embedding(body: EmbeddingRequest, request: Request):
        return await handlers.embeddings(body, request)

    if state.settings.allow_runtime_lora_updating:
        # Applied between two engine steps (run_in_engine): never under a running step.
        @app.post("/v1/load_lora_adapter", responses=_ERROR_RESPONSES)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            await state.engine.run_in_engine(lambda e: e.load_lora(body.lora_name, body.lora_path))
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", responses=_ERROR_RESPONSES)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            await state.engine.run_in_engine(lambda e: e.unload_lora(body.lora_name))
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                            media_type="text/plain")

    @app.get("/v1/models")
    async def list_models():
        base = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kiln",
                "root": state.model_root, "parent": None, "max_model_len": state.engine.max_model_len}
        adapters = [{**base, "id": a.lora_name, "root": a.lora_path, "parent": state.model_name}
                    for a in state.adapters()]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if not state.engine.is_alive:
            err = state.engine.dead_error
            return error_response(503, f"the engine loop is not running: {err}" if err else
                                  "the engine loop is not running", "service_unavailable", None, "engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": kiln_version()}

    @app.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        handlers.check_model(body.model)
        tok = state.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            conv = ChatCompletionRequest(messages=body.messages).conversation()
            ids = handlers.chat_prompt_ids(conv, body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        handlers.check_model(body.model)
        handlers.check_token_ids(body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, exc: QueueFullError):
        return error_response(503, str(exc), "service_unavailable", None, "overloaded")

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "service_unavailable", None, "engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal server error: {type(exc).__name__}", "server_error")


# ---------------------------------------------------------------- completions and chat
class _RequestFailed(Exception):
    """The engine finished a request with an error (FinishReason.ERROR)."""


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    streamed: int = 0  # chat with tools or reasoning: chars of the content already sent
    reasoning_sent: int = 0  # chat with a reasoning parser: chars of the reasoning already sent
    call: ToolCall | None = None  # a streamed named tool call (its id stays the same)


@dataclass
class _Job:
    """One HTTP request: its engine streams (one per prompt) and what they produced so far."""

    id: str
    kind: str  # "completion" | "chat"
    streams: list[RequestStream]
    n: int
    prompt_texts: list[str | None]
    params: SamplingParams
    echo: bool = False
    prompt_only: bool = False  # echo with max_tokens=0: the generated token is dropped
    tool_mode: ToolMode | None = None  # chat with tools
    reasoning: ReasoningParser | None = None  # chat with a reasoning parser (unconstrained output)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0

    def close(self) -> None:
        for s in self.streams:
            s.close()


def _tool_finish_reason(mode: ToolMode, calls: list[ToolCall], finish: str | None) -> str | None:
    """OpenAI's finish reasons with tools: "tool_calls" when the model chose to call (auto,
    required); a named choice keeps "stop", as OpenAI's API does."""
    if calls and finish == "stop" and mode.kind != "named":
        return "tool_calls"
    return finish


def _split_answer(job: "_Job", text: str, final: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a chat answer: the reasoning parser's split when the job has one."""
    if job.reasoning is None:
        return None, text
    reasoning, content = job.reasoning.split(text, final)
    return reasoning, content or ""


def _chat_stream_delta(job: "_Job", ch: _Choice, piece: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The delta of one streamed chat choice with a reasoning parser or tools. Reasoning streams
    as reasoning_content; a named call streams its arguments as they come; auto streams content
    up to where a call may start; calls are sent when the output ends."""
    ch.text += piece
    final = finish is not None
    reasoning, content = _split_answer(job, ch.text, final)
    delta: dict[str, Any] = {}
    if reasoning and len(reasoning) > ch.reasoning_sent:
        delta["reasoning_content"] = reasoning[ch.reasoning_sent:]
        ch.reasoning_sent = len(reasoning)
    mode = job.tool_mode
    if mode is None:
        if len(content) > ch.streamed:
            delta["content"] = content[ch.streamed:]
            ch.streamed = len(content)
        return delta, finish
    if mode.kind == "named":
        new, ch.streamed = content[ch.streamed:], len(content)
        if ch.call is None:
            ch.call = ToolCall(mode.name, new)
            delta["tool_calls"] = [ch.call.to_openai(0)]
            return delta, _tool_finish_reason(mode, [ch.call], finish)
        if new:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": new}}]
        return delta, finish
    if not final:
        safe = mode.streamable(content)
        if safe > ch.streamed:
            delta["content"] = content[ch.streamed:safe]
            ch.streamed = safe
        return delta, None
    answer, calls = mode.calls(content)
    sent = content[:ch.streamed]
    rest = (answer or "")[len(sent):] if (answer or "").startswith(sent) else ""
    if rest:
        delta["content"] = rest
    if calls:
        delta["tool_calls"] = [c.to_openai(k) for k, c in enumerate(calls)]
    return delta, _tool_finish_reason(mode, calls, finish)


class _Handlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    # ---- checks ----
    def check_model(self, model: str | None) -> LoRARequest | None:
        """None for the base model; the adapter's LoRARequest for a LoRA adapter's name; else 404."""
        if model is None or model == self.state.model_name or model in self.state.settings.model_names:
            return None
        lora = self.engine.engine.lora
        entry = lora.get(model) if lora is not None else None
        if entry is not None:
            return entry.request
        served = ", ".join(repr(m) for m in [self.state.model_name, *(a.lora_name for a in self.state.adapters())])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                       "invalid_request_error", "model", "model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab}); got {bad[:3]}", param)

    def _check_params(self, body, params: SamplingParams, num_prompts: int) -> None:
        unknown = body.unknown_fields()
        if unknown:
            logger.info("ignoring unknown request fields: %s", ", ".join(unknown))
        max_seqs = self.engine.engine.settings.max_num_seqs
        if params.n > max_seqs:
            raise InvalidRequestError(f"n ({params.n}) exceeds this server's max_num_seqs ({max_seqs})", "n")
        if num_prompts * params.n > max(max_seqs, 1) * 16:
            raise InvalidRequestError(f"too many prompts in one request ({num_prompts} x n={params.n})", "prompt")
        for name, ids in params.token_id_fields():
            self.check_token_ids(ids, name)

    async def _check_constraint(self, body, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint off the event loop, so that one
        that does not compile is a 400 naming the field it came in (the engine's own compile of
        it is then a cache hit)."""
        if params.structured_outputs is None:
            return
        found = body.structured_output_field()
        name, spec = found if found is not None else ("tools", params.structured_outputs)
        try:
            await asyncio.to_thread(self.engine.engine.structured_output.compile, spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), name) from exc

    def chat_prompt_ids(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
        tok = self.state.tokenizer
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError("continue_final_message needs add_generation_prompt=false",
                                          "continue_final_message")
            if conversation[-1]["role"] != "assistant":
                raise InvalidRequestError("continue_final_message needs an assistant message last",
                                          "continue_final_message")
        kwargs = dict(template_kwargs or {})
        reserved = set(kwargs) & {"conversation", "tokenize", "add_generation_prompt", "tools",
                                  "continue_final_message"}
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                                      "chat_template_kwargs")
        try:
            text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools, continue_final_message=continue_final_message, **kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise InvalidRequestError(f"messages: the chat template failed: {exc}", "messages") from exc
        return tok.encode(text, add_special_tokens=False)

    # ---- endpoints ----
    async def completion(self, body: CompletionRequest, request: Request):
        lora = self.check_model(body.model)
        prompts = body.prompts()
        params = body.sampling_params()
        params = apply_generation_defaults(params, self.engine.engine.generation_defaults, body.model_fields_set)
        self._check_params(body, params, len(prompts))
        await self._check_constraint(body, params)
        texts = [p if isinstance(p, str) else None for p in prompts]
        if body.use_beam_search:
            ids = [self.engine.engine.encode_prompt(p)[1] for p in prompts]
            return await self._beam_search(body, "completion", ids, texts, params, lora)
        job = await self._start("cmpl", "completion", prompts, texts, params, body.priority, request, lora)
        job.echo = body.echo
        job.prompt_only = body.prompt_only
        return await self._respond(job, body.stream, body.include_usage, request, body.continuous_usage)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        lora = self.check_model(body.model)
        tool_mode = body.tool_mode(self.state.settings.auto_tool_parser)
        params = body.sampling_params(tool_mode)
        params = apply_generation_defaults(params, self.engine.engine.generation_defaults, body.model_fields_set)
        ids = self.chat_prompt_ids(body.conversation(), body.add_generation_prompt, body.template_tools(),
                                   body.continue_final_message, body.chat_template_kwargs)
        self._check_params(body, params, 1)
        await self._check_constraint(body, params)
        if self.state.settings.reasoning_parser is not None and params.structured_outputs is not None:
            # The constraint starts once the model has closed its thinking block.
            tok = self.state.tokenizer
            markers = tuple(tuple(tok.encode(m, add_special_tokens=False)) for m in ("<think>", "</think>"))
            params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning_markers=markers)
        if body.use_beam_search:
            return await self._beam_search(body, "chat", [ids], [None], params, lora)
        job = await self._start("chatcmpl", "chat", [ids], [None], params, body.priority, request, lora)
        job.tool_mode = tool_mode if tool_mode.kind != "none" else None
        kind = self.state.settings.reasoning_parser
        if kind is not None:
            job.reasoning = ReasoningParser(kind)
        return await self._respond(job, body.stream, body.include_usage, request, body.continuous_usage)

    async def embeddings(self, body: EmbeddingRequest, request: Request):
        """Each input's pooled final hidden state (EngineSettings.pooling_type), as floats or base64."""
        lora = self.check_model(body.model)
        prompts = body.prompts()
        if len(prompts) > max(self.engine.engine.settings.max_num_seqs, 1) * 16:
            raise InvalidRequestError(f"too many inputs in one request ({len(prompts)})", "input")
        pooling = PoolingParams(self.engine.engine.settings.pooling_type, body.normalize, body.dimensions)
        arrival = time.monotonic()
        job_id = f"embd-{uuid.uuid4().hex}"
        results = await asyncio.gather(*(
            self.engine.add_request(prompt, SamplingParams(), f"{job_id}-{i}", body.priority, arrival, lora, pooling)
            for i, prompt in enumerate(prompts)), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        try:
            if errors:
                raise errors[0]

            async def last(stream: RequestStream) -> RequestOutput:
                out = None
                async for out in stream:
                    pass
                return out

            gather = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
            watch = asyncio.ensure_future(_wait_disconnect(request))
            timeout = self.state.settings.request_timeout
            try:
                done, _ = await asyncio.wait({gather, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    logger.info("%s: client disconnected; aborting", job_id)
                    return Response(status_code=499)
                if gather not in done:
                    raise APIError(504, f"the request did not finish within request_timeout={timeout}s and was "
                                   "aborted", "timeout", None, "timeout")
                outs = gather.result()
            finally:
                for t in (gather, watch):
                    t.cancel()
        finally:
            for s in streams:
                s.close()
        data = []
        for i, out in enumerate(outs):
            if out is None or out.embedding is None:
                raise APIError(500, f"the request failed in the engine: {out.error if out else 'no output'}",
                               "server_error", None, "engine_error")
            vector: Any = out.embedding
            if body.encoding_format == "base64":
                vector = base64.b64encode(array.array("f", vector).tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": job_id, "object": "list", "created": int(time.time()),
                "model": body.model or self.state.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _beam_search(self, body, kind: str, prompts: list[list[int]], texts: list[str | None],
                           params: SamplingParams, lora: LoRARequest | None) -> dict[str, Any]:
        """n beams per prompt (vLLM's use_beam_search): every step of every beam is a one-token
        request through the engine; all prompts' beams of a step run together."""
        from engine.beam_search import Beam, BeamSearchParams, best, expand, to_output

        if body.stream:
            raise InvalidRequestError("use_beam_search cannot stream", "stream")
        if params.structured_outputs is not None or getattr(body, "tools", None):
            raise InvalidRequestError("use_beam_search does not combine with structured outputs or tools",
                                      "use_beam_search")
        engine = self.engine.engine
        max_tokens = params.max_tokens or engine.max_model_len - max(len(p) for p in prompts)
        search = BeamSearchParams(params.n, max_tokens, params.ignore_eos, body.length_penalty)
        for ids in prompts:
            engine.check_room(len(ids), max_tokens)
        step = search.step_params()

        async def one_step(tokens: list[int]) -> dict[int, float]:
            stream = await self.engine.add_request(tokens, dataclasses.replace(step), None, body.priority, None, lora)
            last = None
            try:
                async for last in stream:
                    pass
            finally:
                stream.close()
            if last is None or last.error or not last.outputs[0].logprobs:
                raise APIError(500, f"a beam search step failed in the engine: {last.error if last else '?'}",
                               "server_error", None, "engine_error")
            return last.outputs[0].logprobs[-1]

        live = [[Beam(list(ids), len(ids))] for ids in prompts]
        finished: list[list[Beam]] = [[] for _ in prompts]
        for _ in range(max_tokens):
            jobs = [(i, beam) for i, beams in enumerate(live) for beam in beams]
            if not jobs:
                break
            options = await asyncio.gather(*(one_step(beam.tokens) for _, beam in jobs))
            for i in range(len(prompts)):
                mine = [k for k, (j, _) in enumerate(jobs) if j == i]
                live[i], done = expand([jobs[k][1] for k in mine], [options[k] for k in mine], search,
                                       engine.eos_token_ids)
                finished[i] += done
        job_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        job = _Job(job_id, kind, [], params.n, texts, params)
        job.echo = getattr(body, "echo", False)
        results = []
        for i, ids in enumerate(prompts):
            out = to_output(job_id, texts[i], best(finished[i], live[i], search), self.state.tokenizer)
            job.num_prompt_tokens += len(ids)
            for c in out.outputs:
                job.num_completion_tokens += len(c.token_ids)
                results.append((_Choice(text=c.text, token_ids=c.token_ids, logprobs=c.logprobs or [],
                                        finish_reason=c.finish_reason), out))
        return self._final_body(job, results)

    async def _start(self, prefix: str, kind: str, prompts: list, texts: list, params: SamplingParams,
                     priority: int, request: Request, lora: LoRARequest | None = None) -> _Job:
        arrival = time.monotonic()
        job_id = f"{prefix}-{uuid.uuid4().hex}"
        # All prompts go into the engine's inbox together, so they are admitted in the same step.
        results = await asyncio.gather(*(
            self.engine.add_request(
                prompt, dataclasses.replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids)),
                f"{job_id}-{i}", priority, arrival, lora)
            for i, prompt in enumerate(prompts)), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s in streams:
                s.close()
            raise errors[0]
        return _Job(job_id, kind, streams, params.n, texts, params)

    async def _respond(self, job: _Job, stream: bool | None, include_usage: bool, request: Request,
                       continuous_usage: bool = False):
        timeout = self.state.settings.request_timeout
        if stream:
            return StreamingResponse(self._sse(job, include_usage, timeout, continuous_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(job))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if collect in done:
                return self._final_body(job, collect.result())
            if watch in done:
                logger.info("%s: client disconnected; aborting", job.id)
                return Response(status_code=499)
            raise APIError(504, f"the request did not finish within request_timeout={timeout}s and was aborted",
                           "timeout", None, "timeout")
        finally:
            for t in (collect, watch):
                t.cancel()
            job.close()

    # ---- engine output plumbing ----
    async def _deltas(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all of the job's streams as they come; for a prompt-only
        job without the token it generated."""
        async for pidx, delta in self._stream_deltas(job):
            if job.prompt_only:
                delta = dataclasses.replace(delta, outputs=[dataclasses.replace(
                    c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                    cumulative_logprob=None if c.cumulative_logprob is None else 0.0) for c in delta.outputs])
            yield pidx, delta

    async def _stream_deltas(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(job.streams) == 1:
            async for delta in job.streams[0]:
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for d in s:
                    queue.put_nowait((i, d, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                queue.put_nowait((i, None, exc))
            finally:
                queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(job.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, d, exc = await queue.get()
                if exc is not None:
                    raise exc
                if d is None:
                    remaining -= 1
                    continue
                yield i, d
        finally:
            for t in tasks:
                t.cancel()

    def _account(self, job: _Job, pidx: int, delta: RequestOutput, seen_prompts: set[int]) -> None:
        if pidx not in seen_prompts:
            seen_prompts.add(pidx)
            job.num_prompt_tokens += len(delta.prompt_token_ids)
        job.num_completion_tokens += sum(len(c.token_ids) for c in delta.outputs)

    def _cached(self, job: _Job) -> int:
        return sum((s.final_output.num_cached_tokens if s.final_output else 0) for s in job.streams)

    async def _collect(self, job: _Job) -> list[tuple[_Choice, RequestOutput]]:
        choices: dict[int, _Choice] = {}
        last: dict[int, RequestOutput] = {}
        seen: set[int] = set()
        async for pidx, delta in self._deltas(job):
            self._account(job, pidx, delta, seen)
            last[pidx] = delta
            for c in delta.outputs:
                if c.finish_reason == "error":
                    raise APIError(500, f"the request failed in the engine: {delta.error or 'unknown error'}",
                                   "server_error", None, "engine_error")
                ch = choices.setdefault(pidx * job.n + c.index, _Choice())
                ch.text += c.text
                ch.token_ids += c.token_ids
                ch.logprobs += c.logprobs or []
                if c.finish_reason:
                    ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        return [(choices.get(i, _Choice(finish_reason="abort")), last.get(i // job.n))
                for i in range(len(job.streams) * job.n)]

    def _usage(self, job: _Job) -> dict[str, Any]:
        return {"prompt_tokens": job.num_prompt_tokens, "completion_tokens": job.num_completion_tokens,
                "total_tokens": job.num_prompt_tokens + job.num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self._cached(job)}}

    def _final_body(self, job: _Job, results: list[tuple[_Choice, RequestOutput | None]]) -> dict[str, Any]:
        created = int(time.time())
        out_choices = []
        for i, (ch, out) in enumerate(results):
            if job.kind == "completion":
                text = ch.text
                lp = None
                if job.params.logprobs is not None:
                    lp = self._completion_logprobs(ch, ch.token_ids, ch.logprobs)
                if job.echo and out is not None:
                    prefix = self._prompt_text(job, i // job.n, out)
                    text = prefix + text
                    if lp is not None:
                        lp = self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, prefix, lp)
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": ch.finish_reason,
                          "stop_reason": ch.stop_reason}
                if job.params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
                out_choices.append(choice)
            else:
                lp = ({"content": self._chat_logprobs(ch.token_ids, ch.logprobs, job.params.logprobs)}
                      if job.params.logprobs is not None else None)
                reasoning, content = _split_answer(job, ch.text, final=True)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if job.reasoning is not None:
                    message = {"role": "assistant", "reasoning_content": reasoning, "content": content or None}
                finish = ch.finish_reason
                if job.tool_mode is not None:
                    answer, calls = job.tool_mode.calls(content)
                    message["content"] = answer
                    if calls:
                        message["tool_calls"] = [c.to_openai() for c in calls]
                    finish = _tool_finish_reason(job.tool_mode, calls, finish)
                out_choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish,
                                    "stop_reason": ch.stop_reason})
        body = {"id": job.id, "object": "text_completion" if job.kind == "completion" else "chat.completion",
                "created": created, "model": self.state.model_name, "choices": out_choices,
                "usage": self._usage(job), "system_fingerprint": None}
        if job.kind == "chat" and job.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(results[0][1] if results else None)
        return body

    async def _sse(self, job: _Job, include_usage: bool, timeout: float | None,
                   continuous_usage: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        base = {"id": job.id, "object": obj, "created": created, "model": self.state.model_name}
        usage_field = {"usage": None} if include_usage else {}

        def chunk(choices: list[dict]) -> str:
            usage = {"usage": self._usage(job)} if continuous_usage else usage_field  # (vLLM's continuous_usage_stats)
            return f"data: {json.dumps({**base, 'choices': choices, **usage})}\n\n"

        choices: dict[int, _Choice] = {}
        seen: set[int] = set()
        try:
            if job.kind == "chat":
                for i in range(len(job.streams) * job.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async with _maybe_timeout(timeout):
                async for pidx, delta in self._deltas(job):
                    self._account(job, pidx, delta, seen)
                    for c in delta.outputs:
                        if c.finish_reason == "error":
                            raise _RequestFailed(delta.error or "unknown error")
                        idx = pidx * job.n + c.index
                        first = idx not in choices
                        ch = choices.setdefault(idx, _Choice())
                        yield chunk([self._stream_choice(job, ch, idx, pidx, c, delta, first)])
            if include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': self._usage(job)})}\n\n"
        except (EngineDeadError, TimeoutError, _RequestFailed) as exc:
            if isinstance(exc, _RequestFailed):
                body = error_body(f"the request failed in the engine: {exc}", "server_error", None, "engine_error")
            elif isinstance(exc, TimeoutError):
                body = error_body(f"the request did not finish within request_timeout={timeout}s and was aborted",
                                  "timeout", None, "timeout")
            else:
                body = error_body(str(exc), "service_unavailable", None, "engine_dead")
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            job.close()
        yield "data: [DONE]\n\n"

    def _stream_choice(self, job: _Job, ch: _Choice, idx: int, pidx: int, c, delta: RequestOutput,
                       first: bool) -> dict[str, Any]:
        lp = None
        if job.kind == "completion":
            text = c.text
            if job.params.logprobs is not None:
                lp = self._completion_logprobs(ch, c.token_ids, c.logprobs or [])
            if first and job.echo:
                prefix = self._prompt_text(job, pidx, delta)
                text = prefix + text
                if lp is not None:
                    lp = self._echo_logprobs(delta.prompt_token_ids, delta.prompt_logprobs, prefix, lp)
            return {"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
        if job.params.logprobs is not None:
            lp = {"content": self._chat_logprobs(c.token_ids, c.logprobs or [], job.params.logprobs)}
        if job.tool_mode is not None or job.reasoning is not None:
            msg, finish = _chat_stream_delta(job, ch, c.text, c.finish_reason)
            return {"index": idx, "delta": msg, "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason}
        msg = {"content": c.text} if c.text or not c.finish_reason else {}
        return {"index": idx, "delta": msg, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    # ---- logprobs formats ----
    def _token_text(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id])

    def _prompt_text(self, job: _Job, pidx: int, out: RequestOutput) -> str:
        text = job.prompt_texts[pidx]
        return text if text is not None else self.state.tokenizer.decode(out.prompt_token_ids)

    def _completion_logprobs(self, ch: _Choice, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            s = self._token_text(tid)
            tokens.append(s)
            token_lps.append(entry.get(tid))
            tops.append({self._token_text(t): v for t, v in entry.items()})
            offsets.append(ch.text_offset)
            ch.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(self, prompt_ids: list[int], prompt_entries: list[dict[int, float] | None] | None,
                       prefix: str, lp: dict) -> dict:
        """Echoed prompt tokens come first, with their prompt logprobs (the first has none)."""
        toks = [self._token_text(t) for t in prompt_ids]
        entries = prompt_entries if prompt_entries is not None else [None] * len(prompt_ids)
        offsets, pos = [], 0
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        token_lps = [None if e is None else e.get(t) for t, e in zip(prompt_ids, entries)]
        tops = [None if e is None else {self._token_text(t): v for t, v in e.items()} for e in entries]
        return {"tokens": toks + lp["tokens"], "token_logprobs": token_lps + lp["token_logprobs"],
                "top_logprobs": tops + lp["top_logprobs"],
                "text_offset": offsets + [o + len(prefix) for o in lp["text_offset"]]}

    def _vllm_prompt_logprobs(self, out: RequestOutput | None) -> list | None:
        """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}} (kiln does not compute ranks: null)."""
        if out is None or out.prompt_logprobs is None:
            return None
        return [None if e is None else {str(t): {"logprob": v, "rank": None, "decoded_token": self._token_text(t)}
                                        for t, v in e.items()} for e in out.prompt_logprobs]

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], top_n: int) -> list[dict]:
        out = []
        for tid, entry in zip(token_ids, entries):
            s = self._token_text(tid)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            out.append({"token": s, "logprob": entry.get(tid), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": (t_s := self._token_text(t)), "logprob": v,
                                          "bytes": list(t_s.encode("utf-8"))} for t, v in top]})
        return out


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def _maybe_timeout(seconds: float | None):
    if seconds is None:
        yield
    else:
        async with asyncio.timeout(seconds):
            yield
