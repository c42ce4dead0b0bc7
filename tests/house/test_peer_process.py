"""tools/peer_process.py, how the peer benchmarks measure one engine's run: its own peak resident
memory (not the largest of every child so far), the moment its output said it was ready, its output."""

from __future__ import annotations

import sys

import pytest

from tools.peer_process import run_measured, split_passthrough

MB = 1 << 20
# prints READY, then touches 200 MB (bytes * n writes every page; bytearray(n) may not)
_BIG = "import time; print('READY', flush=True); time.sleep(0.2); x = b'x' * (200 << 20); print(len(x))"


def test_peak_rss_and_ready_are_the_childs_own():
    big = run_measured([sys.executable, "-c", _BIG], lambda line, at: at if line.startswith("READY") else None, 60)
    assert big.returncode == 0 and big.stdout.split() == ["READY", str(200 * MB)]
    assert big.peak_rss >= 200 * MB
    assert big.ready_s is not None and 0 < big.ready_s <= big.wall_s - 0.2
    # a small process after it: its own peak, not the big one's (RUSAGE_CHILDREN would say >= 200 MB)
    small = run_measured([sys.executable, "-c", "import sys; sys.stderr.write('no ready line')"], None, 60)
    assert small.returncode == 0 and small.stderr == "no ready line" and small.ready_s is None
    assert 0 < small.peak_rss < 100 * MB


def test_ready_rule_may_date_back_and_timeout_kills():
    # llama.cpp's rule: the arrival less the run the line reports
    got = run_measured([sys.executable, "-c", "print('t=0.5')"], lambda line, at: at - 0.5, 60)
    assert got.ready_s is not None and got.ready_s < got.wall_s - 0.4
    with pytest.raises(TimeoutError):
        run_measured([sys.executable, "-c", "import time; time.sleep(30)"], None, 0.5)


def test_split_passthrough_gives_the_servers_flags_after_the_first_double_dash():
    assert split_passthrough(["m", "--runs", "2"]) == (["m", "--runs", "2"], [])
    assert split_passthrough(["m", "--", "--max-model-len", "8k", "--", "x"]) == (
        ["m"],
        ["--max-model-len", "8k", "--", "x"],
    )
    assert split_passthrough(["--"]) == ([], [])
