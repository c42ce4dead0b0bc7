"""kiln bench overhead runs end to end: serial and overlapped loops side by side, with ratios."""

from engine.bench.overhead import main


def test_bench_overhead_prints_both_loops_and_the_ratio(capsys):
    assert main(["--steps", "4", "--batches", "1,8", "--enforce-eager"]) in (0, None)
    out = capsys.readouterr().out
    for batch in ("1", "8"):
        rows = [line.split() for line in out.splitlines() if line.split()[:1] == [batch]]
        loops = {r[1] for r in rows if len(r) > 2}
        assert {"serial", "overlap"} <= loops, out
    assert out.count("critical path overlap / serial") == 2, out


def test_bench_overhead_with_penalties_or_a_grammar_in_the_batch(capsys):
    for mix in ("penalties", "grammar"):
        assert main(["--steps", "3", "--batches", "8", "--enforce-eager", "--mix", mix]) in (0, None)
        out = capsys.readouterr().out
        assert f"{mix} in 1 of every 8 requests" in out and "critical path overlap / serial" in out, out


def test_bench_overhead_offline_requests(capsys):
    assert main(["--steps", "3", "--batches", "8", "--enforce-eager", "--offline"]) in (0, None)
    out = capsys.readouterr().out
    assert "offline (final output only" in out and "critical path overlap / serial" in out, out
