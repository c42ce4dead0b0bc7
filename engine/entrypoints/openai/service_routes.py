"""GET /v1/models, the LoRA admin endpoints, /health and /ping, /metrics, /model_info and /version."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from engine.entrypoints.openai.errors import ERROR_RESPONSES, error_response
from engine.entrypoints.openai.metrics import CONTENT_TYPE
from engine.entrypoints.openai.protocol import ErrorResponse, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from engine.entrypoints.openai.request_body import BoundedJSONRoute
from engine.entrypoints.openai.state import kiln_version
from engine.lora.validate import check_adapter_dir, check_adapter_name, confined_adapter_dir


def list_models(state) -> dict:
    base = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "kiln",
        "root": state.model_root,
        "parent": None,
        "max_model_len": state.info.max_model_len,
    }
    adapters = [{**base, "id": a.lora_name, "root": a.lora_path, "parent": state.model_name} for a in state.adapters()]
    return {"object": "list", "data": [base, *adapters]}


def health(state) -> Response:
    """200 {"status": "ready"} while the engine loop runs (the port is bound only once it does);
    503 once it has died or the server is shutting down."""
    if state.draining:
        return error_response(503, "the server is shutting down", "service_unavailable", None, "shutting_down")
    if not state.engine.is_alive:
        err = state.engine.dead_error
        return error_response(
            503,
            f"the engine loop is not running: {err}" if err else "the engine loop is not running",
            "service_unavailable",
            None,
            "engine_dead",
        )
    return Response('{"status": "ready"}', media_type="application/json")


def router(state) -> APIRouter:
    r = APIRouter(route_class=BoundedJSONRoute)

    @r.get("/v1/models")
    async def models():
        return list_models(state)

    @r.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(model_id: str):
        for entry in list_models(state)["data"]:
            if entry["id"] == model_id or (entry["parent"] is None and model_id in state.settings.model_names):
                return entry
        return error_response(
            404, f"the model {model_id!r} does not exist", "invalid_request_error", "model", "model_not_found"
        )

    if state.settings.allow_runtime_lora_updating:
        roots = [root.expanduser().resolve() for root in state.settings.lora_adapter_roots or []]

        def adapter_dir(path: str) -> str:
            found = str(confined_adapter_dir(path, roots))
            check_adapter_dir(found)
            return found

        # Applied between two engine steps (AsyncEngine.load_lora): never under a running step.
        @r.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            check_adapter_name(body.lora_name, [state.model_name, *state.settings.model_names])
            path = await state.off_loop(adapter_dir, body.lora_path)
            await state.engine.load_lora(body.lora_name, path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @r.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            await state.engine.unload_lora(body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @r.get("/health", responses={503: {"model": ErrorResponse}})
    async def health_route():
        return health(state)

    # SageMaker's liveness probe, as vLLM serves it: the same answer as /health (kept out of the
    # schema as the other plumbing routes are).
    @r.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def ping():
        return health(state)

    @r.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_info() -> dict:
        # The served name where SGLang gives paths: a router needs the id it routes, not where the
        # server's files are.
        info = state.info
        return {
            "model_path": state.model_name,
            "served_model_name": state.model_name,
            "tokenizer_path": state.model_name,
            "is_generation": info.generates,
            "max_context_length": info.max_model_len,
            "vocab_size": info.vocab_size,
            "eos_token_ids": list(info.eos_token_ids),
        }

    # sglang-router reads these when a replica registers: the model id it routes and lists under.
    # Router plumbing, not part of the OpenAI API: kept out of /openapi.json.
    r.add_api_route("/model_info", model_info, methods=["GET"], include_in_schema=False)
    r.add_api_route("/server_info", model_info, methods=["GET"], include_in_schema=False)

    @r.get("/version")
    async def version():
        return {"version": kiln_version()}

    return r
