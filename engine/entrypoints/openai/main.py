"""`kiln serve`: build the engine and the app, bind (loopback by default), print the URL, serve."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading

from engine.config.server_settings import ServerSettings
from engine.config.settings import EngineSettings
from engine.entrypoints.openai.app import ServerState, build_app, create_state
from engine.entrypoints.openai.http_options import add_http_middleware, uvicorn_options

logger = logging.getLogger("engine.entrypoints.openai")

FATAL_EXIT_S = 6.0  # after a fatal engine error, the process exits by then at the latest

__all__ = ["serve", "create_app", "build_app", "create_state", "ServerState"]


def create_app(engine_settings: EngineSettings, server_settings: ServerSettings | None = None):
    """A ready FastAPI app (the engine loop starts with the app's lifespan)."""
    return build_app(create_state(engine_settings, server_settings))


def _bind(host: str, port: int) -> socket.socket:
    """Bound, not yet listening: the port is ours (a taken one fails now), but connections to it
    are refused at once until `listen()` (so start-up never leaves a client hanging)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.setblocking(False)
    return sock


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's shutdown (stop accepting, wait for connections) with kiln's drain beside it:
        in-flight requests get shutdown_timeout seconds, then are ended cleanly (ServerState.drain)."""

        def __init__(self, config, state: ServerState) -> None:
            super().__init__(config)
            self.kiln_state = state

        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(self.kiln_state.drain(self.kiln_state.settings.shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                drain.cancel()

    return DrainingServer


def _after_ready(state: ServerState) -> None:
    """What the server loads once it answers, on one thread, in order: transformers' tokenizer
    behind kiln's fast form (chat templates; engine/models/loader/fast_tokenizer.py), then the
    structured-output compile workers (xgrammar, which imports transformers too: two threads
    importing it at once fail). Not on the first request that needs them, and not before ready,
    where they held the GIL while uvicorn started (issue 40)."""

    def load() -> None:
        try:
            getattr(state.tokenizer, "transformers_tokenizer", None)
        except Exception:  # noqa: BLE001 - retried by the first request that needs it
            logger.exception("could not load transformers' tokenizer")
        try:
            state.engine.grammar_compiler.start_pool()
        except Exception:  # noqa: BLE001 - retried by the first constrained request
            logger.exception("could not start the grammar compile workers")

    threading.Thread(target=load, name="kiln-after-ready", daemon=True).start()


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _exit_on_fatal(server, reason: str) -> None:
    """The engine cannot run another step (a tensor-parallel worker died): shut down, and exit
    non-zero within FATAL_EXIT_S even if a collective hangs."""
    logger.error("shutting down: %s", reason)
    server.should_exit = True

    def hard_exit() -> None:
        print(f"kiln: error: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(FATAL_EXIT_S, hard_exit)
    timer.daemon = True
    timer.start()


def freeze_start_up_objects(gc_thresholds: tuple[int, ...] | None) -> None:
    """Start-up's objects (torch, transformers, the tokenizer: ~350,000 for the tiny model) out of
    the collector's reach: a full collection walked them all, ~0.3 s holding the GIL, and any
    request that makes many objects (a large body) triggers one. Cycles made later are collected,
    under gc_thresholds where start-up changed them."""
    if gc_thresholds is not None:
        gc.set_threshold(*gc_thresholds)
    # Only the young generations first: a full collection here walked them all too (0.15 s of a
    # warm start, issue 40) and found about ten unreachable objects to spare from freezing.
    gc.collect(1)
    gc.freeze()


def serve(
    engine_settings: EngineSettings, server_settings: ServerSettings, gc_thresholds: tuple[int, ...] | None = None
) -> int:
    """Serve until stopped. gc_thresholds: the collector's thresholds to put back once ready (`kiln
    serve` defers full collections through start-up: engine/entrypoints/cli/main.py)."""
    import uvicorn

    logging.getLogger("engine").setLevel(server_settings.log_level.upper())
    # Bind first: a taken port fails fast, before the model loads; listen only once it has.
    try:
        sock = _bind(server_settings.host, server_settings.port)
    except OSError as exc:
        print(f"kiln: error: cannot listen on {server_settings.host}:{server_settings.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    if server_settings.host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning(
            "listening on %s: the API is reachable from other machines%s",
            server_settings.host,
            "" if server_settings.api_key else " and no --api-key is set",
        )
    try:
        state = create_state(engine_settings, server_settings)
    except BaseException:
        sock.close()
        raise
    app = build_app(state)
    add_http_middleware(app, server_settings)
    freeze_start_up_objects(gc_thresholds)
    # uvicorn's own limit is a backstop: ServerState.drain ends every request within shutdown_timeout.
    config = uvicorn.Config(
        app,
        timeout_graceful_shutdown=server_settings.shutdown_timeout + 10,
        log_config=None,
        **uvicorn_options(server_settings),
    )
    server = _server_class()(config, state)
    sock.listen(2048)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            _after_ready(state)
            base = _url(server_settings.host, port, "https" if server_settings.ssl_keyfile else "http")
            print(f"kiln: serving {state.model_name!r} at {base}/v1 (health: {base}/health)", flush=True)
            key = " -H 'Authorization: Bearer $KEY'" if server_settings.api_key else ""
            print(
                f"kiln: try  curl {base}/v1/completions{key} -H 'Content-Type: application/json' "
                f'-d \'{{"model": {json.dumps(state.model_name)}, "prompt": "Hello", "max_tokens": 16}}\'',
                flush=True,
            )
        while not task.done() and state.engine.fatal is None:
            await asyncio.wait([task], timeout=0.1)
        if state.engine.fatal is not None:
            _exit_on_fatal(server, state.engine.fatal)
        await task

    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with this
    # handler in place (restored by uvicorn) a SIGTERM ends `kiln serve` with exit status 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    if state.engine.fatal is not None:
        # The engine's process group is broken: skip the interpreter's teardown (it can wait on it).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 1 if state.engine.crashed else 0
