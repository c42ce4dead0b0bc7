"""The Responses API's store: bounded in count, bytes and age (oldest dropped first), each entry
visible only to its owner (the hashed API key); and, through the app in-process, a turn stored
with one key is neither read, continued nor deleted with another, and a stream of either API
that cannot finish ends with that API's error event."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.entrypoints.openai.response_store import ResponseStore, owner_of
from tests.support.server import app_states, slow_steps

A, B = owner_of("key-a"), owner_of("key-b")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_count_bytes_and_age_bounds():
    clock = Clock()
    store = ResponseStore(max_entries=3, max_bytes=10_000, max_age_s=60, clock=clock)
    for i in range(5):
        assert store.put(f"r{i}", A, {"i": i}, [])
    assert len(store) == 3 and store.get("r0", A) is None and store.get("r4", A).body == {"i": 4}

    big = {"text": "x" * 6000}
    assert store.put("big1", A, big, []) and store.put("big2", A, big, [])
    assert store.bytes <= 10_000 and len(store) == 1  # everything older made room, oldest first
    assert store.get("big1", A) is None and store.get("r4", A) is None
    assert not store.put("huge", A, {"text": "x" * 20_000}, [])  # alone over the bound: not stored
    assert store.get("huge", A) is None and store.get("big2", A) is not None

    clock.now = 61
    assert store.get("big2", A) is None and len(store) == 0 and store.bytes == 0
    assert not ResponseStore(max_entries=0).put("r", A, {}, [])


def test_only_the_owner_sees_or_deletes():
    store = ResponseStore()
    store.put("r", A, {"id": "r"}, [{"role": "user", "content": "hi"}])
    assert store.get("r", B) is None and not store.delete("r", B)
    assert store.get("r", A).items == [{"role": "user", "content": "hi"}]
    assert store.delete("r", A) and store.get("r", A) is None and store.bytes == 0


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=256, num_gpu_blocks=64, max_num_seqs=2)


def test_stored_turns_are_visible_only_with_their_key(app_state):
    state, app = app_state()  # (no --api-key: any key is accepted, and each is its own owner)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            a = {"Authorization": "Bearer key-a"}
            made = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}, headers=a)
            rid = made.json()["id"]
            other = [
                await http.get(f"/v1/responses/{rid}", headers={"x-api-key": "key-b"}),
                await http.get(f"/v1/responses/{rid}"),  # no key at all
                await http.post(
                    "/v1/responses",
                    json={"input": "more", "previous_response_id": rid, "max_output_tokens": 2},
                    headers={"Authorization": "Bearer key-b"},
                ),
                await http.delete(f"/v1/responses/{rid}", headers={"Authorization": "Bearer key-b"}),
            ]
            own = await http.get(f"/v1/responses/{rid}", headers={"x-api-key": "key-a"})  # the same key, either header
            return made, other, own

    made, other, own = asyncio.run(main())
    assert made.status_code == 200, made.text
    assert [r.status_code for r in other] == [404, 404, 404, 404]
    assert own.status_code == 200 and own.json() == made.json()


def test_streams_that_cannot_finish_end_with_each_apis_error_event(app_state):
    state, app = app_state(server={"request_timeout": 0.3})
    slow_steps(state, 0.05)
    bodies = {
        "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True},
        "/v1/responses": {"input": "hi", "max_output_tokens": 100, "stream": True},
    }

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return {path: await http.post(path, json={**body, "temperature": 0}) for path, body in bodies.items()}

    out = asyncio.run(main())
    messages = [e for e in out["/v1/messages"].text.split("\n\n") if e]
    assert messages[0].startswith("event: message_start") and messages[-1].startswith("event: error\n"), messages
    error = json.loads(messages[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "timeout_error", "message": error["error"]["message"]}}
    assert "request_timeout=0.3s" in error["error"]["message"]

    responses = [e for e in out["/v1/responses"].text.split("\n\n") if e]
    assert responses[0].startswith("event: response.created") and responses[-1].startswith("event: error\n")
    event = json.loads(responses[-1].split("data: ", 1)[1])
    assert event["type"] == "error" and event["code"] == "timeout" and event["sequence_number"] == len(responses) - 1
    assert state.responses.get(json.loads(responses[0].split("data: ", 1)[1])["response"]["id"], owner_of("")) is None
