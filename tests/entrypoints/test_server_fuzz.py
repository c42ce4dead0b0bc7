"""Fuzz every operation of /openapi.json (schemathesis, in-process ASGI): no request may cause a 5xx.

The engine is small (max_model_len 64, 4 sequences) so that valid generated requests stay cheap.
Afterwards the engine must be alive, idle and hold no KV blocks.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from engine.config.server_settings import ServerSettings
from engine.config.settings import EngineSettings
from engine.entrypoints.openai.app import build_app, create_state
from tests.support.engine import assert_engine_clean


@pytest.fixture(scope="module")
def fuzz_state(tiny_llama):
    state = create_state(
        EngineSettings(
            model=str(tiny_llama),
            device="cpu",
            enforce_eager=True,
            max_model_len=64,
            num_gpu_blocks=128,
            max_num_seqs=4,
            log_stats_interval=0,
        ),
        ServerSettings(served_model_name="fuzz"),
    )
    state.engine._idle_poll_s = 0.05
    state.engine.start()
    yield state
    deadline = time.monotonic() + 20
    while not state.engine.engine.core.is_idle_and_free() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.engine.is_alive, state.engine.dead_error
    state.engine.shutdown()
    assert_engine_clean(state.engine.engine)


@pytest.fixture(scope="module")
def app_schema(fuzz_state):
    # The test owns the engine loop: the app must not stop it from its lifespan.
    return schemathesis.openapi.from_asgi("/openapi.json", build_app(fuzz_state, manage_engine=False))


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
]


def test_schema_lists_every_operation(app_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in app_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


# Negative cases (bodies that break the schema) exist only where there is a body.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_openapi_no_server_errors(app_schema, fuzz_state, method, path, mode):
    operation = app_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "fuzz"  # reach past the model check (404 is tested elsewhere)
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and path == "/v1/responses":
            # (valid inputs are easy to make here: keep each answer short, as the other routes' are)
            case.body["max_output_tokens"] = min(case.body.get("max_output_tokens") or 4, 4)
        response = case.call()
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:500]}"
        )
        assert fuzz_state.engine.is_alive, fuzz_state.engine.dead_error
        if response.status_code >= 400:
            body = response.json()
            if path.startswith("/v1/messages"):  # (Anthropic's shape)
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, body

    check()
