"""tools/peer_server.py, the benchmarks' way to run a peer server: ready when /v1/models answers,
stopped (its whole process group) when the block ends, and a server that dies at start-up is a
clear error, not a hang or a stray process."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from tools.peer_server import core_count, running_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_core_count():
    assert core_count("0-3,6") == 5 and core_count("2") == 1


def test_server_is_ready_then_stopped(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")
    port = _free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with running_server(cmd, dict(os.environ), tmp_path / "server.log", port, 30, tmp_path) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None


def test_a_server_that_dies_at_start_up_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match=r"server exited \(3\) before it was ready"):
        with running_server(
            [sys.executable, "-c", "raise SystemExit(3)"],
            dict(os.environ),
            tmp_path / "server.log",
            _free_port(),
            30,
            tmp_path,
        ):
            pass
