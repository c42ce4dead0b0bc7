"""The served tiny model that the server tests share: one `kiln serve` process per session
(test_server.py, test_server_structured.py, test_server_load.py: the OpenAI API; test_server_apis.py:
the Responses and Messages APIs)."""

from __future__ import annotations

import openai
import pytest

from tests.support.server import API_KEY, MAX_MODEL_LEN, MODEL, launch_server, stop_server, wait_clean


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    proc, url = launch_server(
        tiny_llama,
        log_path,
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-gpu-blocks",
        "1024",
        "--max-num-seqs",
        "64",
        "--log-stats-interval",
        "1",
    )
    yield url
    stop_server(proc, log_path)
    log = log_path.read_text()
    assert "request_id=" in log  # access log lines
    assert "prefix hit rate" in log  # the periodic stats line


@pytest.fixture
def url(server):
    yield server
    wait_clean(server)


@pytest.fixture
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c
