"""POST /v1/embeddings and its response format."""

from __future__ import annotations

import array
import asyncio
import base64
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.core.outputs import RequestOutput
from engine.core.params import PoolingParams
from engine.entrypoints.openai.admission import check_model, check_params, fit_prompts, prompt_ids
from engine.entrypoints.openai.errors import engine_failed, post_route
from engine.entrypoints.openai.jobs import until_done
from engine.entrypoints.openai.protocol import EmbeddingRequest
from engine.runtime.request_stream import RequestStream


def embedding_body(body: EmbeddingRequest, job_id: str, model: str, outs: list[RequestOutput]) -> dict[str, Any]:
    data = []
    for i, out in enumerate(outs):
        if out is None or out.embedding is None:
            raise engine_failed(out.error if out is not None and out.error else "no embedding")
        vector: Any = out.embedding
        if body.encoding_format == "base64":
            vector = base64.b64encode(array.array("f", vector).tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "id": job_id,
        "object": "list",
        "created": int(time.time()),
        "model": body.model or model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def create_embedding(state, body: EmbeddingRequest, request: Request):
    """Each input's pooled final hidden state (EngineSettings.pooling_type), as floats or base64."""
    lora = check_model(state, body.model)
    prompts = body.prompts()
    pooling = PoolingParams(state.info.pooling_type, body.normalize, body.dimensions)
    params, task = check_params(state, None, len(prompts), pooling)
    ids = fit_prompts(state, await prompt_ids(state, prompts, "input"), params, "input")
    arrival = time.monotonic()
    job_id = f"embd-{uuid.uuid4().hex}"
    admission = state.admission
    results = await asyncio.gather(
        *(
            state.engine.submit(admission.request(None, p, params, task, f"{job_id}-{i}", body.priority, arrival, lora))
            for i, p in enumerate(ids)
        ),
        return_exceptions=True,
    )
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

        outs = await until_done(
            asyncio.gather(*(last(s) for s in streams)), request, state.settings.request_timeout, job_id
        )
    finally:
        for s in streams:
            s.close()
    if outs is None:
        return Response(status_code=499)
    return embedding_body(body, job_id, state.model_name, outs)


def router(state) -> APIRouter:
    r = APIRouter()
    post_route(r, "/v1/embeddings", EmbeddingRequest, create_embedding, state)
    return r
