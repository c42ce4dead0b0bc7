"""`kiln bench latency` with quantised models: weight memory against bf16, and the baseline
(transformers on the dequantised weights) agreeing with kiln."""

from __future__ import annotations

import json

import pytest

from engine.bench import latency

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("quantization,linear_ratio", [("gptq", (0.25, 0.30)), ("fp8", (0.50, 0.52))])
def test_load_only_memory(quantization, linear_ratio, tiny_llama, tmp_path):
    out = tmp_path / "mem.json"
    rc = latency.main(
        [
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--load-format",
            "dummy",
            "--quantization",
            quantization,
            "--load-only",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    row = json.loads(out.read_text())
    assert row["quantization"] == quantization
    lo, hi = linear_ratio  # int4: half a byte per weight + group scales; fp8: a byte + a scale per row
    assert lo < row["linear_ratio_to_bf16"] < hi
    assert row["ratio_to_bf16"] < 1.0 and row["weight_GB"] > 0


def test_latency_on_gptq_checkpoint_with_baseline(tiny_llama, tmp_path):
    from tests.support.quant_checkpoints import write_quantized

    quant_dir, _ = write_quantized(tiny_llama, tmp_path, "gptq", bits=4, group_size=32)
    out = tmp_path / "lat.json"
    rc = latency.main(
        [
            "--model",
            str(quant_dir),
            "--device",
            "cpu",
            "--enforce-eager",
            "--batch-size",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--warmup-steps",
            "2",
            "--baseline",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    row = json.loads(out.read_text())
    assert row["first_token_agreement"] == 1.0  # transformers runs the dequantised weights
    assert row["weight_GB"] > 0
