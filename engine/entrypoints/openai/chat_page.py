"""GET /: kiln's chat page (chat_page.html, shipped in the package), a static page that talks to
this server's /v1/models and /v1/chat/completions. `--no-serve-chat-page` leaves it out (/ is
then a 404, as in vLLM).

The page is on the API key's public list (middleware.PUBLIC_ROUTES): it holds no data and starts
no work, and every request it makes carries the key the user types into it. Its Content-Security-
Policy lets it load nothing from elsewhere and connect only to this server."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

CHAT_PAGE_ROUTE = "/"

# Inline script and style only (the page is one file); fetches go to this origin only.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def page_html() -> str:
    return (files("engine.entrypoints.openai") / "chat_page.html").read_text(encoding="utf-8")


def router(state) -> APIRouter:
    r = APIRouter()
    html = page_html()  # (read once, when the app is built)
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }

    @r.get(CHAT_PAGE_ROUTE, include_in_schema=False)
    async def chat_page():
        return HTMLResponse(html, headers=headers)

    return r
