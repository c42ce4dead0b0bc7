"""Engines under test: block accounting checked after use, stepping with checks, the app in-process."""

from __future__ import annotations

import contextlib

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")


def assert_engine_clean(engine) -> None:
    """Block accounting holds and nothing is left referenced: call after every engine test."""
    engine.core.check_integrity()
    assert not engine.core.has_unfinished_requests(), "requests left unfinished"
    assert engine.core.pool.is_fully_free(), (
        f"KV blocks leaked: {engine.core.pool.num_in_use} in use after all requests finished"
    )


def sampler_output(out, per_seq: list[list[int]]):
    """A fake model's tokens (one list per scheduled sequence, in step order: n at a fork, one per
    position with drafts, none for a chunk that samples nothing) as the sampler hands them over."""
    from engine.core.outputs import SamplerOutput

    flat = [t for toks in per_seq for t in toks]
    return SamplerOutput(flat, [None] * len(flat))


def take_updates(updates, got: dict, done: dict) -> None:
    """What an output side sees of the core's updates: each request's tokens per sample (`got`),
    and, once the core is done with a request, its samples' tokens in `done`."""
    for update in updates:
        samples = got.setdefault(update.request_id, {})
        for seq in update.seqs:
            samples.setdefault(seq.index, []).extend(seq.token_ids)
        if update.finished:
            done[update.request_id] = [samples[i] for i in sorted(samples)]


def run_checked(engine) -> dict:
    """Step the engine until every request has finished, checking block accounting after each
    step; returns {request id: final RequestOutput}."""
    done = {}
    while engine.core.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.core.check_integrity()
    return done


@contextlib.contextmanager
def served(model, server: dict | None = None, **engine):
    """The app in-process on a started engine (CPU, eager; settings overridable), with an httpx
    client on its ASGI transport and the official AsyncOpenAI client on that. Yields
    (state, http, client); shuts the engine down and checks its pool afterwards."""
    import httpx
    import openai

    from engine.config.server_settings import ServerSettings
    from engine.config.settings import EngineSettings
    from engine.entrypoints.openai.app import build_app, create_state

    settings = dict(
        model=str(model),
        device="cpu",
        enforce_eager=True,
        max_model_len=256,
        num_gpu_blocks=128,
        max_num_seqs=4,
        log_stats_interval=0,
    )
    settings.update(engine)
    state = create_state(EngineSettings(**settings), ServerSettings(**({"served_model_name": "m"} | (server or {}))))
    state.engine.start()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t")
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
    try:
        yield state, http, client
    finally:
        state.engine.shutdown()
    assert_engine_clean(state.engine.engine)
