"""kiln bench overhead runs end to end: serial and overlapped loops side by side, with ratios, and
a row per (batch, loop) with every phase timed."""

import json

from engine.bench.overhead import PHASES, main


def _rows(tmp_path, capsys, *args: str) -> tuple[list[dict], str]:
    path = tmp_path / "overhead.json"
    assert main([*args, "--enforce-eager", "--json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def _check(rows: list[dict], batches: list[int]) -> None:
    assert sorted((r["batch"], r["loop"]) for r in rows) == sorted(
        (b, loop) for b in batches for loop in ("serial", "overlap")
    )
    for r in rows:  # (medians over the steps: each phase's median is at most the total's)
        assert all(0 <= r[p] <= r["total"] for p in PHASES), r
        assert r["process"] > 0 and r["schedule"] > 0 and r["prep"] > 0, r  # every phase ran and was timed
        if r["loop"] == "serial":
            assert r["critical"] == r["total"], r
        else:  # the overlapped loop's output processing is off the critical path
            assert r["critical"] <= r["total"], r


def test_bench_overhead_prints_both_loops_and_the_ratio(tmp_path, capsys):
    rows, out = _rows(tmp_path, capsys, "--steps", "4", "--batches", "1,8")
    _check(rows, [1, 8])
    for batch in ("1", "8"):
        printed = [line.split() for line in out.splitlines() if line.split()[:1] == [batch]]
        assert {"serial", "overlap"} <= {r[1] for r in printed if len(r) > 2}, out
    assert out.count("critical path overlap / serial") == 2, out


def test_bench_overhead_with_penalties_or_a_grammar_in_the_batch(tmp_path, capsys):
    for mix in ("penalties", "grammar"):
        rows, out = _rows(tmp_path, capsys, "--steps", "3", "--batches", "8", "--mix", mix)
        _check(rows, [8])
        assert all(r["mix"] == mix for r in rows)
        assert f"{mix} in 1 of every 8 requests" in out and "critical path overlap / serial" in out, out


def test_bench_overhead_offline_requests(tmp_path, capsys):
    rows, out = _rows(tmp_path, capsys, "--steps", "3", "--batches", "8", "--offline")
    _check(rows, [8])
    assert all(r["offline"] for r in rows)
    assert "offline (final output only" in out and "critical path overlap / serial" in out, out
