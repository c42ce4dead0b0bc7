"""tools/peer_server.py, the benchmarks' way to run a peer server: ready when /v1/models answers,
stopped (its whole process group) when the block ends, its time to ready and the peak RSS of its
processes measured, and a server that dies at start-up is a clear error, not a hang or a stray
process."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from tools.peer_server import core_count, group_peak_rss, running_server

MB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_core_count():
    assert core_count("0-3,6") == 5 and core_count("2") == 1


def test_server_is_ready_then_stopped_and_measured(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")
    port = _free_port()
    # the server's group: the HTTP server and a child of it that holds 150 MB (summed with it)
    hold = "import time; x = b'x' * (150 << 20); time.sleep(120)"
    serve = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {hold!r}]); "
    serve += f"sys.argv = ['http.server', '{port}', '--bind', '127.0.0.1']; import runpy; "
    serve += "runpy.run_module('http.server', run_name='__main__')"
    cmd = [sys.executable, "-c", serve]
    with running_server(cmd, dict(os.environ), tmp_path / "server.log", port, 30, tmp_path) as server:
        assert server.proc.poll() is None
        assert 0 < server.ready_s < 30
        deadline = time.monotonic() + 30
        while group_peak_rss(server.proc.pid)[0] < 150 * MB and time.monotonic() < deadline:
            time.sleep(0.05)  # (the child touching its pages)
    assert server.proc.poll() is not None
    assert server.processes == 2 and 150 * MB < server.peak_rss < 400 * MB
    # PSS counts the pages the two share (the interpreter's) once: below the RSS sum, above the 150 MB
    assert 150 * MB < server.peak_pss < server.peak_rss
    assert "ready" in server.describe() and "2 processes" in server.describe()
    assert server.figures()["processes"] == 2 and server.figures()["peak_pss_GB"] == server.peak_pss / 1e9


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
