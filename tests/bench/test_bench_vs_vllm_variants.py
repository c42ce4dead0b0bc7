"""tools/bench_vs_vllm.py's kiln-against-itself options: variant flags, the medians-and-ratios
table, and the mixed workload's prompts (short ones plus the documented share of long ones)."""

from __future__ import annotations

import argparse
import json

import pytest
from transformers import AutoTokenizer

from tools.bench_vs_vllm import Bench, _variant, _variant_table


def test_variant_flags_and_table():
    assert _variant("itl80=--target-itl-ms 80") == ("itl80", ["--target-itl-ms", "80"])
    assert _variant("base=") == ("base", [])
    for bad in ("=--x", "vllm=--x"):
        with pytest.raises(SystemExit):
            _variant(bad)
    metrics = {
        "output_throughput": 100.0,
        "median_ttft_ms": 50.0,
        "p99_ttft_ms": 80.0,
        "median_tpot_ms": 10.0,
        "p99_tpot_ms": 20.0,
        "median_itl_ms": 10.0,
        "p99_itl_ms": 40.0,
        "ready_s": 12.0,
        "peak_pss_GB": 1.2,
        "peak_rss_GB": 1.5,
    }
    runs = {"base": [metrics, {**metrics, "p99_itl_ms": 60.0}, metrics], "new": [{**metrics, "p99_itl_ms": 20.0}] * 3}
    table = _variant_table(runs, ["base", "new"])
    row = next(line for line in table.splitlines() if line.startswith("ITL p99"))
    assert row.split()[-3:] == ["40.0", "20.0", "0.50x"]  # medians, then new/base
    rss = next(line for line in table.splitlines() if line.startswith("peak RSS GB"))
    assert rss.split()[-3:] == ["1.5", "1.5", "1.00x"]


def test_mixed_prompts_are_short_and_long_in_the_given_share(tiny_llama, tmp_path):
    args = argparse.Namespace(
        model=str(tiny_llama),
        out_dir=str(tmp_path),
        vllm_venv=str(tmp_path),
        cores="0",
        kv_cache_gb=1,
        dtype="float32",
        max_num_seqs=4,
        kiln_python="python",
        kiln_arg=[],
        kiln_variant=[],
        serve_prompts=40,
        input_len=16,
        mix_long_fraction=0.25,
        mix_long_len="200,300",
        serve_dataset="mixed",
        output_len=8,
    )
    bench = Bench(args)
    path = bench.mixed_dataset()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    lengths = [len(tok(json.loads(line)["prompt"]).input_ids) for line in path.read_text().splitlines()]
    assert len(lengths) == 40
    # (random ids re-tokenise to more tokens with the tiny test tokenizer: SmolLM2's stay within ~15%)
    long = [n for n in lengths if n > 100]
    assert 5 <= len(long) <= 15  # about a quarter (seeded draw)
    assert all(160 <= n <= 600 for n in long) and all(n <= 48 for n in lengths if n <= 100)
    assert "--dataset-path" in bench.dataset_args() and bench.mixed_dataset().read_text() == path.read_text()
