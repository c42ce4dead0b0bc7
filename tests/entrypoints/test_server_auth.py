"""The API key is default-deny: every route of the app, enumerated from the app itself (so a
route added later is covered without editing this file), answers 401 without the key or with a
wrong one, with and without a root path; only the documented public routes answer without it."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import httpx
import pytest

from engine.entrypoints.cli.main import parse_serve_args
from engine.entrypoints.openai.app import build_app
from engine.entrypoints.openai.middleware import PUBLIC_ROUTES
from tests.support.engine import served

KEY = "s3cret"


def app_routes(routes, prefix: str = ""):
    """(path, method) of every HTTP route the app serves, through included routers."""
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's included router
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from app_routes(inner.routes, prefix + (getattr(context, "prefix", "") or ""))
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                yield prefix + route.path, method


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


@pytest.fixture(scope="module")
def keyed_app(tiny_llama, tmp_path_factory):
    roots = [str(tmp_path_factory.mktemp("adapters"))]
    with served(
        tiny_llama, server={"api_key": KEY, "allow_runtime_lora_updating": True, "lora_adapter_roots": roots}
    ) as (state, http, _):
        yield state, http._transport.app


def _statuses(app, root_path: str, headers: dict) -> dict:
    routes = sorted(set(app_routes(app.routes)))
    assert len(routes) >= 15, routes  # the whole API, not an empty walk

    async def main():
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            out = {}
            for path, method in routes:
                resp = await http.request(method, root_path + concrete(path), headers=headers, json={})
                out[(path, method)] = resp.status_code
            # A path that matches no route needs the key too (default deny).
            out[("/no/such/route", "GET")] = (await http.get(root_path + "/no/such/route", headers=headers)).status_code
            # Without the root path's prefix, as a proxy might forward it.
            out[("/v1/models (unprefixed)", "GET")] = (await http.get("/v1/models", headers=headers)).status_code
            return out

    return asyncio.run(main())


@pytest.mark.parametrize("root_path", ["", "/api", "/v1"])
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": f"Basic {KEY}"}],
    ids=["none", "wrong", "x-wrong", "basic"],
)
def test_every_route_needs_the_key(keyed_app, root_path, headers):
    state, app = keyed_app
    statuses = _statuses(app, root_path, headers)
    open_routes = {route: code for route, code in statuses.items() if code != 401 and route[0] not in PUBLIC_ROUTES}
    assert not open_routes, f"answered without the key under root_path={root_path!r}: {open_routes}"
    assert statuses[("/health", "GET")] == 200 and statuses[("/ping", "GET")] == 200


@pytest.mark.parametrize("root_path", ["", "/api"])
def test_the_key_opens_every_route(keyed_app, root_path):
    state, app = keyed_app
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        statuses = _statuses(app, root_path, headers)
        assert statuses[("/v1/models", "GET")] == 200
        assert statuses[("/metrics", "GET")] == 200
        assert all(code != 401 for code in statuses.values()), statuses


def test_model_info_names_no_file(keyed_app, tiny_llama):
    state, app = keyed_app

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [
                (await http.get(p, headers={"Authorization": f"Bearer {KEY}"})).text
                for p in ("/model_info", "/server_info")
            ]

    for text in asyncio.run(main()):
        assert str(tiny_llama) not in text and tiny_llama.name not in text, text
        assert '"served_model_name":"m"' in text


def test_public_metrics_opens_metrics_only(tiny_llama):
    with served(tiny_llama, server={"api_key": KEY, "public_metrics": True}) as (state, http, _):

        async def main():
            return [(await http.get(p)).status_code for p in ("/metrics", "/v1/models", "/version")]

        assert asyncio.run(main()) == [200, 401, 401]


def test_the_chat_page_can_be_left_out(keyed_app, monkeypatch):
    """--no-serve-chat-page: nothing at / (a 404 with the key or without, as in vLLM), and the
    key's rule unchanged: the API needs it, the probes do not. (The same engine, a second app.)"""
    state, app = keyed_app
    monkeypatch.delenv("KILN_SERVE_CHAT_PAGE", raising=False)
    assert parse_serve_args([])[1].serve_chat_page is True
    assert parse_serve_args(["--no-serve-chat-page"])[1].serve_chat_page is False
    settings = state.settings.model_copy(update={"serve_chat_page": False})
    off = build_app(dataclasses.replace(state, settings=settings), manage_engine=False)
    assert ("/", "GET") in set(app_routes(app.routes)) and ("/", "GET") not in set(app_routes(off.routes))
    key = {"Authorization": f"Bearer {KEY}"}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=off), base_url="http://t") as http:
            asks = [("/", {}), ("/", key), ("/v1/models", {}), ("/v1/models", key), ("/health", {}), ("/ping", {})]
            return [(await http.get(path, headers=headers)).status_code for path, headers in asks]

    assert asyncio.run(main()) == [404, 404, 401, 200, 200, 200]
