"""POST /tokenize and /detokenize (vLLM's extensions)."""

from __future__ import annotations

from fastapi import APIRouter

from engine.core import admission_rules as rules
from engine.entrypoints.openai.admission import check_model, check_text_size, encode
from engine.entrypoints.openai.chat import conversation_ids
from engine.entrypoints.openai.errors import ERROR_RESPONSES
from engine.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest, conversation
from engine.entrypoints.openai.request_body import BoundedJSONRoute


async def tokenize(state, body: TokenizeRequest) -> dict:
    check_model(state, body.model)
    rules.one_of_prompt_messages(body.prompt is not None, body.messages is not None)
    if body.messages is not None:
        ids = await conversation_ids(state, conversation(body.messages), body.add_generation_prompt)
    else:
        check_text_size(state.info, state.max_token_chars, body.prompt, "prompt")
        ids = await state.off_loop(encode, state.tokenizer, body.prompt, body.add_special_tokens, size=len(body.prompt))
    return {"tokens": ids, "count": len(ids), "max_model_len": state.info.max_model_len}


async def detokenize(state, body: DetokenizeRequest) -> dict:
    check_model(state, body.model)
    state.admission.check_token_ids(body.tokens, "tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens)}


def router(state) -> APIRouter:
    r = APIRouter(route_class=BoundedJSONRoute)

    @r.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(state, body)

    @r.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(state, body)

    return r
