"""The HTTP layer's failure contract (issue 27, items 4, 5 and 8), through kiln's uvicorn
protocol on a loopback socket: ambiguous framings are a 400 and the connection closes (nothing
smuggled behind them is answered); idle, partial-header and stalled-body connections time out;
an endless chunked body is cut at the body limit and the connection closes after the 413;
every 503 carries Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import pytest

from engine.entrypoints.openai.http_protocol import framing_problem
from tests.support.server import app_states, serving, slow_steps


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=128, num_gpu_blocks=64, max_num_seqs=2)


def exchange(port: int, data: bytes, wait: float = 5.0) -> tuple[bytes, bool]:
    """Send `data`, read until the server closes or `wait` passes: (what came back, closed?)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait)
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out, False
        return out, True


# ---- 4: request smuggling ----
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
AMBIGUOUS = {
    "CL and TE": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "TE and CL": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 40\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "two CL": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"
    + SMUGGLED,
    "CL list": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}" + SMUGGLED,
    "obs-fold": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: a\r\n Content-Length: 2\r\n\r\n{}" + SMUGGLED,
    "bare LF": b"GET /v1/models HTTP/1.1\nHost: x\n\n" + SMUGGLED,
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n{}\r\n0\r\n\r\n" + SMUGGLED,
    "TE in HTTP/1.0": b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "two Host": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n" + SMUGGLED,
    "bare LF ends the head": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\n" + SMUGGLED,
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SMUGGLED,
}


def test_ambiguous_framings_are_400_and_close(app_state):
    state, app = app_state()
    with serving(app, state.settings) as port:
        # The control: two pipelined requests on one connection are both answered.
        out, _ = exchange(port, SMUGGLED + SMUGGLED, wait=1.0)
        assert out.count(b"HTTP/1.1 200") == 2, out[:300]
        for name, raw in AMBIGUOUS.items():
            out, closed = exchange(port, raw)
            assert out.startswith(b"HTTP/1.1 400 "), (name, out[:300])
            assert closed, name
            assert out.count(b"\r\n\r\n") == 1 and b'"object": "list"' not in out, (name, out)  # nothing smuggled
            assert b"connection: close" in out.lower(), name


def test_framing_check_on_its_own():
    ok = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    assert framing_problem(ok) is None
    assert framing_problem(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le") is None  # not complete yet
    assert framing_problem(b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n") is None  # an empty line first is allowed
    assert framing_problem(ok.replace(b"Content-Length: 2", b"content-length: 2\r\nTransfer-Encoding: chunked"))
    assert framing_problem(b"GET / HTTP/1.1\r\nHost: x\r\nA: b\rc\r\n\r\n") == "a header line holds a bare CR"
    assert "closing empty line" in framing_problem(b"GET / HTTP/1.1\r\nHost: x\r\n\n")
    assert "HTTP/2" in framing_problem(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert framing_problem(b"GET / HTTP/3.0\r\nHost: x\r\n\r\n") == "not an HTTP/1.0 or HTTP/1.1 request line"


# ---- 5: timeouts, the body limit ----
def test_idle_and_partial_header_connections_close(app_state):
    state, app = app_state(server={"http_idle_timeout_s": 1.0, "http_header_timeout_s": 1.5})
    with serving(app, state.settings) as port:
        # Each partial head goes out as its connection opens: a connection still silent after
        # http_idle_timeout_s is closed as idle (and a head sent after that is answered by a reset).
        partial = []
        for _ in range(250):
            partial.append(socket.create_connection(("127.0.0.1", port)))
            partial[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(250)]
        t0 = time.monotonic()
        answers = []
        for s in idle + partial:
            s.settimeout(max(0.1, t0 + 10 - time.monotonic()))
            out = b""
            try:
                while chunk := s.recv(4096):
                    out += chunk
            except TimeoutError:
                out = None  # still open
            answers.append(out)
            s.close()
        elapsed = time.monotonic() - t0
    assert all(a == b"" for a in answers[:250]), "idle connections must close without an answer"
    assert all(a is not None and a.startswith(b"HTTP/1.1 408 ") for a in answers[250:]), answers[250:][:3]
    assert elapsed < 8.0, elapsed  # (1.5 s of timeouts; the rest is a loaded machine reading 500 sockets)


def test_stalled_body_is_answered_408(app_state):
    state, app = app_state(server={"http_body_timeout_s": 0.5})
    with serving(app, state.settings) as port:
        t0 = time.monotonic()
        out, closed = exchange(
            port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": "Hel',
            wait=5,
        )
        assert out.startswith(b"HTTP/1.1 408 ") and closed, out
        assert time.monotonic() - t0 < 3
        # A whole request on a fresh connection is still served.
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_trickled_body_meets_the_deadline(app_state):
    # A byte every 0.2 s never stalls for http_body_timeout_s, but the whole body has a deadline.
    state, app = app_state(server={"http_body_timeout_s": 0.5, "http_body_deadline_s": 1.5})
    with serving(app, state.settings) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        t0 = time.monotonic()
        s.settimeout(0.2)
        out = b""
        while time.monotonic() - t0 < 6 and not out:
            try:
                s.sendall(b" ")
                out = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        assert out.startswith(b"HTTP/1.1 408 ") and b"http_body_deadline_s" in out, out
        assert 1.4 < time.monotonic() - t0 < 4


def test_endless_chunked_body_is_cut_at_the_limit(app_state):
    state, app = app_state(server={"max_request_body_mb": 1})
    limit = 1 << 20
    consumed = [0]

    async def counting(scope, receive, send):  # what the app read of the body
        async def counted():
            message = await receive()
            consumed[0] += len(message.get("body", b""))
            return message

        await app(scope, counted, send)

    with serving(counting, state.settings) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            stop = threading.Event()

            def flood():
                chunk = b"10000\r\n" + b"a" * 0x10000 + b"\r\n"
                with contextlib.suppress(OSError):
                    while not stop.is_set():
                        s.sendall(chunk)

            sender = threading.Thread(target=flood, daemon=True)
            sender.start()
            s.settimeout(10)
            out = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):
                    out += chunk
            stop.set()
            sender.join(10)
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert b"connection: close" in out.lower()
    assert consumed[0] <= 3 * limit, consumed[0]  # (the limit, then at most one limit more to let the 413 through)


def test_declared_oversized_body_gets_413_and_close(app_state):
    state, app = app_state(server={"max_request_body_mb": 1})
    with serving(app, state.settings) as port:
        out, closed = exchange(
            port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 50000000\r\n\r\n{"prompt": "',
            wait=5,
        )
    assert out.startswith(b"HTTP/1.1 413 ") and closed, out[:300]
    assert b"connection: close" in out.lower()


# ---- 8: Retry-After ----
def test_every_503_carries_retry_after(app_state):
    state, app = app_state(max_num_seqs=1, max_waiting_requests=1, server={"retry_after_s": 3})
    slow_steps(state, 0.02)
    sched = state.engine.engine.core.scheduler
    body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}

    async def until(pred):
        deadline = time.monotonic() + 20
        while not pred():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await until(lambda: len(sched.running) == 1)
            second = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await until(lambda: len(sched.waiting) == 1)
            full = await http.post("/v1/completions", json=body)
            state.draining = True
            draining = await http.post("/v1/completions", json=body)
            health = await http.get("/health")
            state.draining = False
            await first, await second
            return full, draining, health

    full, draining, health = asyncio.run(main())
    for resp, code in ((full, "overloaded"), (draining, "shutting_down"), (health, "shutting_down")):
        assert resp.status_code == 503 and resp.json()["error"]["code"] == code, resp.text
        assert resp.headers["retry-after"] == "3", resp.headers


# ---- proxy headers: trusted only from the proxies the operator names ----
@pytest.mark.parametrize("allow, seen", [(None, "127.0.0.1"), (["127.0.0.1"], "203.0.113.9")])
def test_forwarded_for_is_trusted_only_from_configured_proxies(app_state, caplog, allow, seen):
    from engine.config.server_settings import ServerSettings

    state, app = app_state()
    settings = ServerSettings(forwarded_allow_ips=allow)
    with caplog.at_level("INFO", logger="engine.entrypoints.openai.access"), serving(app, settings) as port:
        resp = httpx.get(f"http://127.0.0.1:{port}/health", headers={"X-Forwarded-For": "203.0.113.9"})
    assert resp.status_code == 200
    lines = [r.getMessage() for r in caplog.records if '"GET /health"' in r.getMessage()]
    assert lines and lines[-1].split()[0] == seen, lines


def test_kept_alive_connections_idle_longer_than_a_new_connection_waits_for_its_head(app_state):
    """A new connection must send its head within http_header_timeout_s; a kept-alive one stays
    open http_idle_timeout_s after its response (longer than clients' own keep-alive: no client
    reuses a connection the server is closing), and a head begun there gets the header timeout."""
    state, app = app_state(server={"http_idle_timeout_s": 2.0, "http_header_timeout_s": 0.5})
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    def answer(s) -> bytes:  # one whole /health answer (its head and body may come apart)
        out = b""
        while not out.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out

    with serving(app, state.settings) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(5)
            s.sendall(request)
            assert answer(s).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.2)  # past the header timeout, inside the idle one: still open
            s.sendall(request)
            assert answer(s).startswith(b"HTTP/1.1 200 ")
            t0 = time.monotonic()
            assert s.recv(65536) == b""  # then closed as idle
            assert 1.5 < time.monotonic() - t0 < 4
        with socket.create_connection(("127.0.0.1", port)) as s:  # a new connection that says nothing
            s.settimeout(5)
            t0 = time.monotonic()
            assert s.recv(65536) == b"" and time.monotonic() - t0 < 1.5
        with socket.create_connection(("127.0.0.1", port)) as s:  # a head begun on a kept-alive one
            s.settimeout(5)
            s.sendall(request)
            answer(s)
            s.sendall(b"GET /health HTTP/1.1\r\nHo")
            t0 = time.monotonic()
            out = s.recv(65536)
            assert out.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < 1.5, out


def test_connection_cap_closes_the_longest_idle_then_refuses(app_state):
    state, app = app_state(server={"http_max_connections": 8, "http_header_timeout_s": 30.0})
    with serving(app, state.settings) as port:
        idle = []
        for _ in range(8):
            idle.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(0.02)  # (the server sees them open in this order)
        # A new client beyond the cap is served: the longest-idle connection makes room.
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        idle[0].settimeout(5)
        assert idle[0].recv(64) == b""  # closed, without an answer
        # Every connection busy (a request head begun): a new one gets a 503 and is closed.
        for s in idle[1:]:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        busy = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for s in busy:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        time.sleep(0.2)
        out, closed = exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 503 ") and closed, out[:200]
        assert b"http_max_connections=8" in out and b"retry-after: 1" in out.lower()
        for s in idle + busy:
            s.close()
