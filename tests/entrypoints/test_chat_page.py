"""The chat page at / (engine/entrypoints/openai/chat_page.html) in a real headless Chromium,
against the shared `kiln serve` process (tests/entrypoints/conftest.py, with an API key): the
page asks for the key, lists the models, streams an answer that is token for token the API's
greedy answer to the same conversation (system prompt and history included), stops a long
answer mid-stream (the server sees the abort), and fetches nothing from elsewhere."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.browser import headless_chromium
from tests.support.server import API_KEY, MODEL, metrics

ABORTED = "kiln:request_success_total{finished_reason=abort}"

# Counts the deltas appended to the last answer (each one replaces the answer's text node).
COUNT_DELTAS = """() => {
  window.__deltas = 0;
  new MutationObserver((records) => {
    for (const r of records) if (r.target.classList && r.target.classList.contains("content")) window.__deltas += 1;
  }).observe(document.getElementById("messages"), { childList: true, subtree: true });
}"""


@pytest.fixture(scope="module")
def browser():
    with headless_chromium(pytest.fail, pytest.skip) as b:
        yield b


@pytest.fixture
def page(browser, url):
    context = browser.new_context()
    page = context.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{url}/")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('API key')")
    page.fill("#key", API_KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function(f"() => document.getElementById('model').value === {MODEL!r}")
    yield page
    context.close()
    outside = [u for u in requested if not u.startswith(f"{url}/")]
    assert not outside, f"the page fetched from elsewhere: {outside}"


def settings(page, temperature: str, max_tokens: int) -> None:
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", str(max_tokens))


def send(page, text: str) -> None:
    """Type a message and press Enter; returns once its answer's bubble is on the page."""
    asked = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function("n => document.querySelectorAll('.msg.assistant').length > n", arg=asked)


def until_idle(page, timeout_s: float = 60) -> None:
    page.wait_for_selector("body[data-state=idle]", state="attached", timeout=timeout_s * 1000)


def answers(page) -> list[str]:
    return page.locator(".msg.assistant .content").all_text_contents()


def test_the_page_streams_the_greedy_answer_with_system_prompt_and_history(page, client):
    settings(page, "0", 12)
    page.click("summary")
    page.fill("#system", "You are kiln.")
    page.evaluate(COUNT_DELTAS)
    send(page, "Hello there")
    until_idle(page)
    assert page.evaluate("() => window.__deltas") >= 2  # the answer came in pieces, as it was generated
    send(page, "And again")
    until_idle(page)

    first, second = answers(page)
    conversation = [{"role": "system", "content": "You are kiln."}, {"role": "user", "content": "Hello there"}]
    for shown in (first, second):
        want = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0, max_tokens=12)
        assert shown and shown == want.choices[0].message.content
        conversation += [{"role": "assistant", "content": shown}, {"role": "user", "content": "And again"}]
    assert (page.text_content("#status") == "stopped at max_tokens") == (want.choices[0].finish_reason == "length")


def test_the_stop_button_aborts_the_request(page, url):
    aborted = metrics(url)[ABORTED]
    settings(page, "0", 900)  # (greedy, it runs to max_tokens: seconds, still running when stopped)
    send(page, "Tell me a long story")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content').textContent.length > 0")
    assert page.locator(".msg.error").count() == 0, answers(page)
    page.click("#stop")
    until_idle(page, 10)
    assert page.text_content("#status") == "stopped"
    shown = answers(page)[0]
    time.sleep(0.5)
    assert answers(page)[0] == shown  # nothing more arrives
    deadline = time.monotonic() + 10
    while metrics(url)[ABORTED] == aborted:
        assert time.monotonic() < deadline, "the server never saw the request aborted"
        time.sleep(0.05)
    # The stopped answer stays in the conversation: the next message goes out after it.
    settings(page, "0", 2)
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Go on")
    until_idle(page)
    assert request.value.post_data_json["messages"] == [
        {"role": "user", "content": "Tell me a long story"},
        {"role": "assistant", "content": shown},
        {"role": "user", "content": "Go on"},
    ]


def test_the_page_is_public_and_the_api_it_calls_is_not(url):
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "<title>kiln chat</title>" in page.text
    assert httpx.get(f"{url}/v1/models").status_code == 401
