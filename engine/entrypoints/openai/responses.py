"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses (whole or streamed), and GET and
DELETE /v1/responses/{id} for stored responses. The request runs as the chat request it asks
for (responses_protocol.py); here the chat answer (its reasoning, text and tool calls, as
chat.py splits them) is written as output items: a `reasoning` item, a `message` with one
`output_text` part, a `function_call` per call. Streamed, as the SDK's events: response.created,
response.in_progress, per item output_item.added, its deltas and their .done events,
output_item.done, then response.completed (or response.incomplete at max_output_tokens).

With `store` (the default) the turn is kept (response_store.py) for `previous_response_id` and
GET, visible only to the API key that made it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.answer_blocks import AnswerBlocks, json_text
from engine.entrypoints.openai.chat import ChatFormat, chat_generation
from engine.entrypoints.openai.errors import APIError, post_route
from engine.entrypoints.openai.generation import generate
from engine.entrypoints.openai.generation_request import GenerationRequest
from engine.entrypoints.openai.jobs import Choice, Job
from engine.entrypoints.openai.middleware import presented_key
from engine.entrypoints.openai.response_store import owner_of
from engine.entrypoints.openai.responses_protocol import ResponsesRequest


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"no stored response with id {response_id!r} for this API key", "invalid_request_error", param, "not_found"
    )


def owner(request: Request) -> str:
    """Whose stored responses this request may see: its API key's (hashed)."""
    headers = {k: request.headers.get(k, "").encode("latin-1") for k in ("authorization", "x-api-key")}
    return owner_of(presented_key(headers["authorization"], headers["x-api-key"]))


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, id_: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": id_ or item_id("rs"), "summary": [], "content": content, "status": status}


def message_item(text: str | None, id_: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": id_ or item_id("msg"), "role": "assistant", "status": status, "content": content}


def call_item(call_id: str, name: str, arguments: str, id_: str | None = None, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": id_ or item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class Turn:
    """One request's response object: the request's echo, its status, output and usage."""

    def __init__(self, body: ResponsesRequest, model: str, response_id: str, owner: str, earlier: list) -> None:
        self.body, self.model, self.id, self.owner = body, model, response_id, owner
        self.earlier = earlier  # the stored items of the turns before this one
        self.created = int(time.time())

    def response(self, output: list[dict], status: str, job: Job | None, finish: str | None = None) -> dict:
        b = self.body
        usage = None
        if job is not None:
            cached = job.cached_tokens()
            usage = {
                "input_tokens": job.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": job.num_completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": job.num_prompt_tokens + job.num_completion_tokens,
            }
        tool_choice: Any = b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump") else b.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "error": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": b.text.model_dump(by_alias=True) if b.text is not None else {"format": {"type": "text"}},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": "disabled",
            "usage": usage,
            "user": b.user,
            "metadata": b.metadata or {},
        }

    def finished(self, state, output: list[dict], job: Job, finish: str | None) -> dict:
        """The final response (stored when asked)."""
        status = "incomplete" if finish == "length" else "completed"
        body = self.response(output, status, job, finish)
        if self.body.store:
            items = [*self.earlier, *self.body.input_items(), *output]
            state.responses.put(self.id, self.owner, body, items)
        return body


class ResponseFormat(ChatFormat):
    """The whole answer as a response object, made from the chat body."""

    def __init__(self, state, turn: Turn) -> None:
        super().__init__(state)
        self.turn = turn

    def final_body(self, job: Job, results: list[tuple[Choice, RequestOutput | None]]) -> dict[str, Any]:
        choice = super().final_body(job, results)["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            output.append(message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            output.append(call_item(call["id"], fn["name"], json_text(fn["arguments"])))
        return self.turn.finished(self.state, output, job, choice["finish_reason"])


class ResponseEvents(AnswerBlocks):
    """The Responses API's stream: one output item per block of the answer."""

    def __init__(self, state, turn: Turn) -> None:
        super().__init__()
        self.state, self.turn = state, turn
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the finished output items
        self.item: dict[str, Any] = {}  # the open one

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": self.index}

    def started(self, kind: str) -> list[str]:
        if kind == "call":
            call = self.call or {}
            self.item = call_item(call["id"], call["name"], "", status="in_progress")
        else:
            self.item = (reasoning_item if kind == "reasoning" else message_item)("", status="in_progress")
            self.item["content"] = []
        out = [self._event("response.output_item.added", output_index=self.index, item=self.item)]
        if kind == "text":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def delta(self, kind: str, text: str) -> list[str]:
        if kind == "call":
            return [self._event("response.function_call_arguments.delta", **self._where(), delta=text)]
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {"logprobs": []} if kind == "text" else {}
        return [self._event(name, **self._where(), content_index=0, delta=text, **extra)]

    def stopped(self, kind: str, text: str) -> list[str]:
        where, out = self._where(), []
        if kind == "call":
            item = call_item(self.item["call_id"], self.item["name"], text, id_=self.item["id"])
            out.append(self._event("response.function_call_arguments.done", **where, arguments=text))
        elif kind == "reasoning":
            item = reasoning_item(text, id_=self.item["id"])
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            item = message_item(text, id_=self.item["id"])
            out.append(self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            part = item["content"][0]
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        self.items.append(item)
        return [*out, self._event("response.output_item.done", output_index=self.index, item=item)]

    def opening(self, job: Job) -> list[str]:
        start = self.turn.response([], "in_progress", None)
        return [self._event("response.created", response=start), self._event("response.in_progress", response=start)]

    def choice(self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool) -> list[str]:
        return self.feed(job, ch, c)

    def closing(self, job: Job) -> list[str]:
        out = self.close()
        body = self.turn.finished(self.state, self.items, job, self.finish[0])
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=body)]

    def failure(self, job: Job, error: dict[str, Any]) -> list[str]:
        err = error["error"]
        return [self._event("error", code=err.get("code"), message=err["message"], param=err.get("param"))]


async def create_response(state, body: ResponsesRequest, request: Request):
    """Run as the chat request it asks for (after the stored turns before it)."""
    who = owner(request)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id, who)
        if stored is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        earlier = stored.items
    gen: GenerationRequest = await chat_generation(state, body.as_chat(earlier), request)
    gen.kind = "response"
    turn = Turn(body, state.model_name, item_id("resp"), who, earlier)
    return await generate(state, gen, ResponseFormat(state, turn), request, ResponseEvents(state, turn))


def router(state) -> APIRouter:
    r = APIRouter()
    post_route(r, "/v1/responses", ResponsesRequest, create_response, state)

    @r.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        stored = state.responses.get(response_id, owner(request))
        if stored is None:
            raise not_found(response_id)
        return stored.body

    @r.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        if not state.responses.delete(response_id, owner(request)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return r
