"""Structured-output compiles (issue 27, items 3 and 9): the compile pool's fairness keys on the
client's address, which it cannot multiply (its `user` field only shares out its address's
turn), and a large but ordinary schema compiles well inside the default time limit (the pool's
workers no longer hand back a serialised grammar)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.server import app_states


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=256, num_gpu_blocks=128, max_num_seqs=4)


def _client(app, address: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=(address, 40000)), base_url="http://t", timeout=120
    )


def _slow_schema(tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(10000)}}


def test_compile_fairness_keys_on_the_address_not_the_user_field(app_state):
    timeout = 4.0
    state, app = app_state(server={"grammar_compile_timeout_s": timeout, "grammar_compile_workers": 2})

    async def main():
        async with _client(app, "10.0.0.1") as mallory, _client(app, "10.0.0.2") as alice:
            warm = await alice.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "guided_regex": "[ab]+"})
            assert warm.status_code == 200, warm.text  # (the workers start with the first constraint: not timed)
            slow = [
                asyncio.ensure_future(
                    mallory.post(
                        "/v1/completions",
                        json={
                            "prompt": "x",
                            "max_tokens": 2,
                            "guided_json": _slow_schema(f"u{k}_"),
                            "user": f"user{k}",
                        },
                    )
                )
                for k in range(6)
            ]  # six `user` values: still one client
            pool = state.engine.grammar_compiler._pool
            deadline = time.monotonic() + 10
            while pool.busy < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            small = await alice.post(
                "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "guided_regex": "[a-z]{3}"}
            )
            waited = time.monotonic() - t0
            busy_with_mallory = pool.busy
            for f in slow:
                f.cancel()
            return small, waited, busy_with_mallory

    small, waited, busy = asyncio.run(main())
    assert small.status_code == 200 and len(small.json()["choices"][0]["text"]) == 3, small.text
    assert busy <= 1  # one client never holds every worker
    assert waited < timeout / 2, waited  # not held behind a compile of the other client's


def test_one_client_may_queue_only_so_many_compiles(app_state):
    state, app = app_state(
        server={"grammar_compile_timeout_s": 4.0, "grammar_compile_workers": 2, "grammar_compile_queue_per_client": 2}
    )

    async def main():
        async with _client(app, "10.0.0.3") as mallory:
            warm = await mallory.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "guided_regex": "[ab]"})
            assert warm.status_code == 200, warm.text
            body = {"prompt": "x", "max_tokens": 2}
            slow = [
                asyncio.ensure_future(
                    mallory.post("/v1/completions", json={**body, "guided_json": _slow_schema(f"q{k}_")})
                )
                for k in range(6)
            ]
            deadline = time.monotonic() + 10
            while sum(f.done() for f in slow) < 3:  # 1 compiling + 2 waiting at most: 3 or more refused
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            refused = [f.result() for f in slow if f.done()]
            for f in slow:
                f.cancel()
            return refused

    refused = asyncio.run(main())
    assert refused and all(r.status_code == 429 for r in refused), [r.text for r in refused]
    error = refused[0].json()["error"]
    assert error["code"] == "too_many_compiles" and "grammar_compile_queue_per_client=2" in error["message"]
    assert refused[0].headers["retry-after"] == "1"


def test_large_required_schema_compiles_within_the_default_limit(app_state):
    state, app = app_state()  # the default grammar_compile_timeout_s (10 s)
    assert state.settings.grammar_compile_timeout_s == 10.0
    n = 1500
    schema = {
        "type": "object",
        "properties": {f"field{i}": {"type": "string"} for i in range(n)},
        "required": [f"field{i}" for i in range(n)],
    }

    async def main():
        async with _client(app, "127.0.0.1") as http:
            # The workers start with kiln serve (here: now, untimed).
            warm = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "guided_regex": "[ab]+"})
            assert warm.status_code == 200, warm.text
            t0 = time.monotonic()
            resp = await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
                },
            )
            return resp, time.monotonic() - t0

    resp, seconds = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"].startswith("{")
    print(f"{n} required properties: answered in {seconds:.2f}s (limit 10s)")


# ---- issue 39: a server stopped as it starts (its grammar workers still starting) ----
def _zygotes() -> set[int]:
    """This process's live compile-pool zygotes."""
    import os
    from pathlib import Path

    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"PPid:\t{os.getpid()}\n" in (proc / "status").read_text():
                if b"engine.structured_output.compile_pool" in (proc / "cmdline").read_bytes():
                    found.add(int(proc.name))
        except OSError:
            continue
    return found


def test_closing_while_the_grammar_workers_start_is_clean(tiny_llama):
    """close() (the server's shutdown) while start_pool() (its start-up thread) is on its way:
    no error in either thread (it was `cannot unpack non-iterable NoneType` when close ran while
    xgrammar loaded), no compile pool left behind, and a compile asked for afterwards is
    refused as the server stopping, not run unbounded here."""
    import threading

    import transformers

    from engine.core.params import StructuredOutputsParams
    from engine.structured_output.compile_pool import CompileCancelled
    from engine.structured_output.grammars import StructuredOutputCompiler

    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    before = _zygotes()
    # Exactly the race: close() runs while the start-up thread loads xgrammar.
    for delay in (None, 0.0, 0.05, 0.3, 1.0):  # (then close at several points of a real start)
        compiler = StructuredOutputCompiler(tok, len(tok), (tok.eos_token_id,))
        compiler.configure(timeout_s=5.0, workers=2)
        errors: list[BaseException] = []
        loading, closed = threading.Event(), threading.Event()
        if delay is None:
            real = compiler._xgrammar_compiler

            def slow_load(real=real):
                loading.set()
                closed.wait(10)
                return real()

            compiler._xgrammar_compiler = slow_load

        def start(compiler=compiler, errors=errors):
            try:
                compiler.start_pool()
            except BaseException as exc:  # noqa: BLE001 - what the test looks for
                errors.append(exc)

        thread = threading.Thread(target=start)
        thread.start()
        if delay is None:
            assert loading.wait(10)
        else:
            time.sleep(delay)
        compiler.close()
        closed.set()
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        assert compiler._pool is None
        with pytest.raises(CompileCancelled):
            compiler.compile(StructuredOutputsParams(regex="ab[0-9]+"))
    deadline = time.monotonic() + 10
    while _zygotes() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _zygotes() - before  # (every zygote started here is gone)


@pytest.mark.slow
def test_kiln_serve_stopped_as_soon_as_it_is_ready_stops_cleanly(tiny_llama, tmp_path):
    """`kiln serve` stopped (SIGTERM) the moment /health answers, while its grammar workers are
    still starting, three times: exit status 0 and no traceback in its log."""
    from tests.support.server import launch_server, stop_server

    for i in range(3):
        log = tmp_path / f"server{i}.log"
        proc, _ = launch_server(tiny_llama, log, "--max-model-len", "256", "--grammar-compile-workers", "2")
        stop_server(proc, log)  # exit status 0, no traceback in the log
