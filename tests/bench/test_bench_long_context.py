"""`kiln bench latency --context-depth`: the depths parse, and a run on the tiny model prints and
writes a row per depth with both engines' figures and their ratios (engine/bench/long_context.py)."""

from __future__ import annotations

import json

import pytest

from engine.bench.long_context import parse_depths


def test_depths_parse_with_k_suffixes_and_refuse_bad_input():
    assert parse_depths("0,4k, 16K,100") == [0, 4096, 16384, 100]
    for bad in ("", "-1", "4m"):
        with pytest.raises(ValueError):
            parse_depths(bad)


def test_depth_run_compares_the_default_with_the_float32_baseline(tiny_llama, tmp_path, capsys):
    from engine.entrypoints.cli.main import main

    out = tmp_path / "rows.json"
    argv = ["bench", "latency", "--model", str(tiny_llama), "--context-depth", "0,40", "--rounds", "1"]
    assert main([*argv, "--output-len", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kiln: KV float16, baseline: KV float32" in printed
    rows = json.loads(out.read_text())
    assert [r["depth"] for r in rows] == [0, 40]
    for r in rows:
        for key in ("decode_tok_per_s", "prefill_tok_per_s"):
            assert r[f"kiln_{key}"] > 0 and r[f"baseline_{key}"] > 0
            assert r[f"ratio_{key}"] == pytest.approx(r[f"kiln_{key}"] / r[f"baseline_{key}"])
    assert main([*argv[:-4], "--context-depth", "x"]) == 2
