"""The FastAPI app: wires the serving modules (completions, chat, embeddings, tokenize,
models/admin, the chat page at /) to one ServerState, behind the middleware and the error handlers.

`build_app(state)` makes the app; `create_state(engine_settings, server_settings)` (state.py)
builds the state. Nothing here is module-level state: two apps in one process share nothing.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from engine.entrypoints.openai import chat, chat_page, completions, embeddings, messages, responses, tokenize
from engine.entrypoints.openai import service_routes as models
from engine.entrypoints.openai.errors import install_error_handlers
from engine.entrypoints.openai.middleware import GateMiddleware, PublicRoutes, RequestContextMiddleware
from engine.entrypoints.openai.state import ServerState, create_state, default_model_name, kiln_version

__all__ = ["build_app", "create_state", "ServerState", "default_model_name", "kiln_version"]


def build_app(state: ServerState, manage_engine: bool = True) -> FastAPI:
    """The app over `state`. With manage_engine, the app's lifespan starts and stops the engine
    loop (and the server's worker pools)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            state.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(state.close)  # (may wait for the grammar compiler's start-up)
                state.engine.shutdown()

    app = FastAPI(
        title="kiln",
        version=kiln_version(),
        lifespan=lifespan,
        description="OpenAI-compatible completions and chat served by kiln",
    )
    app.state.kiln = state
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(
        RequestContextMiddleware,
        api_key=state.settings.api_key,  # outermost: logs every request
        public_routes=PublicRoutes(state.settings.public_metrics),
        retry_after_s=state.settings.retry_after_s,
    )
    install_error_handlers(app)
    for module in (completions, chat, messages, responses, embeddings, tokenize, models):
        app.include_router(module.router(state))
    if state.settings.serve_chat_page:
        app.include_router(chat_page.router(state))
    return app
