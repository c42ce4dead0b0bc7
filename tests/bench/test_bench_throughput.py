"""`kiln bench throughput`: both sides run the same workload, alternating, and the ratio is printed."""

from __future__ import annotations

import json

from engine.bench.throughput import main


def test_bench_throughput_alternates_and_prints_ratios(tiny_llama, tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(
        [
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--num-requests",
            "6",
            "--prompt-len",
            "4,12",
            "--output-len",
            "2,6",
            "--max-num-seqs",
            "4",
            "--repeats",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "fastest of 2" in text and "ratio kiln / transformers:" in text and "per CPU second" in text
    r = json.loads(out.read_text())
    assert r["kiln_output_tokens"] == r["hf_output_tokens"] > 0  # the same useful tokens counted on both sides
    assert len(r["kiln_seconds_all"]) == len(r["hf_seconds_all"]) == 2
    assert r["kiln_seconds"] == min(r["kiln_seconds_all"]) and r["hf_seconds"] == min(r["hf_seconds_all"])
    assert r["ratio"] > 0 and r["median_pair_ratio"] > 0 and r["cpu_time_ratio"] > 0
    assert r["hf_batch_size"] == 4
