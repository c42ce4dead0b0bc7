"""The server under test: in-process apps, uvicorn on a loopback port, a `kiln serve` process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine.config.server_settings import ServerSettings
from engine.config.settings import EngineSettings
from engine.entrypoints.openai.app import build_app, create_state
from engine.entrypoints.openai.http_options import uvicorn_options
from tests.support.engine import assert_engine_clean


def app_states(model, **defaults):
    """A factory of started (state, app) pairs on `model` (settings: these defaults, then the
    call's); every engine is stopped and checked clean afterwards. Use as a fixture's body."""
    states = []

    def _make(server: dict | None = None, **overrides):
        settings = dict(model=str(model), device="cpu", enforce_eager=True, log_stats_interval=0)
        settings.update(defaults)
        settings.update(overrides)
        state = create_state(EngineSettings(**settings), ServerSettings(served_model_name="m", **(server or {})))
        state.engine._idle_poll_s = 0.05
        state.engine.start()
        states.append(state)
        return state, build_app(state)

    yield _make
    for state in states:
        state.close()
        state.engine.shutdown()
        assert_engine_clean(state.engine.engine)


def slow_steps(state, seconds: float) -> None:
    """Every engine step takes at least `seconds` longer (requests stay in flight)."""
    real_step = state.engine.engine.core.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    state.engine.engine.core.step = slow_step


@contextlib.contextmanager
def serving(app, settings):
    """`app` served by uvicorn with kiln's options on a free loopback port (a thread of its own)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, **uvicorn_options(settings)))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextlib.contextmanager
def startup_objects_frozen():
    """The process's objects so far out of the collector's reach for the block, as `kiln serve`
    freezes its start-up objects (engine/entrypoints/openai/main.py). An in-process server shares
    the test process, whose full collections walk everything pytest and the fixtures made: ~0.3 s
    holding the GIL, 2-3 s on a loaded machine, a stall of every thread that `kiln serve` never
    has (and a request that makes many objects, a large body, is what triggers one)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


API_KEY = "sk-kiln-test"


MODEL = "tiny"


MAX_MODEL_LEN = 1024  # long enough that a 1000-token request is surely still running when we look


ROOT = Path(__file__).resolve().parents[2]


def launch_server(model_dir: Path, log_path: Path, *extra: str, cwd: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """Start `kiln serve` on a free loopback port (port 0; the URL is read from its stdout), from
    the checkout `cwd` (its code wins over the installed one)."""
    cmd = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--device",
        "cpu",
        "--enforce-eager",
        *extra,
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    url = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("kiln: serving"):
            url = line.split(" at ", 1)[1].split("/v1", 1)[0]
            break
    if url is None:
        proc.kill()
        raise RuntimeError(f"server did not start: {log_path.read_text()[-3000:]}")
    for _ in range(100):
        if httpx.get(f"{url}/health").status_code == 200:
            return proc, url
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server never became healthy")


def stop_server(proc: subprocess.Popen, log_path: Path) -> None:
    proc.terminate()
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = log_path.read_text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def metrics(url: str) -> dict[str, float]:
    """Samples of kiln:* metrics: 'name{label=value,...}' (model_name left out) -> value."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("kiln:"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_clean(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["kiln:num_requests_running"], m["kiln:num_requests_waiting"], m["kiln:num_kv_blocks_in_use"]) == (
            0,
            0,
            0,
        ):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"server not clean: running={m['kiln:num_requests_running']} "
                f"waiting={m['kiln:num_requests_waiting']} blocks={m['kiln:num_kv_blocks_in_use']}"
            )
        time.sleep(0.05)


AUTH = {"Authorization": f"Bearer {API_KEY}"}
