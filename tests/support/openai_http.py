"""Plain HTTP against the served tiny model (tests/entrypoints/conftest.py's server): a POST with the
test API key, a strict SSE parse, and an OpenAI-shaped error body checked and returned."""

from __future__ import annotations

import json

import httpx

from tests.support.server import API_KEY


def post(url: str, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    if isinstance(body, (bytes, str)):
        return httpx.post(
            f"{url}{path}", content=body, headers={**headers, "content-type": "application/json"}, timeout=60
        )
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def sse_events(resp: httpx.Response) -> list:
    """Parse a raw SSE body strictly: every event is one `data: ...` line and a blank line."""
    events = []
    for block in resp.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def error_body(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]
