"""`kiln bench latency` on the CPU (tiny model, eager to keep it quick) and the presets it uses."""

from __future__ import annotations

import json

import pytest
import torch

from engine.bench import latency
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


def test_latency_bench_cpu_with_baseline(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = latency.main(
        [
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--enforce-eager",
            "--batch-size",
            "1,3",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--warmup-steps",
            "2",
            "--baseline",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_steps"] == 5  # output 6: one token from the prefill step, five decode steps
        assert r["ms_per_step"] > 0 and 0 < r["step_ms_median"] <= r["step_ms_p99"]
        assert (r["backend"], r["cuda_graphs"], r["device"]) == ("torch", False, "cpu")  # what made the figure
        assert r["weight_GB"] > 0 and r["copy_GBps"] > 0 and 0 < r["bandwidth_share"]
        assert r["hf_ms_per_step"] > 0 and r["speedup_per_step"] > 0
        # same weights, float32: kiln's and transformers' first greedy tokens agree
        assert r["first_token_agreement"] == 1.0
    text = capsys.readouterr().out
    assert "transformers generate" in text and "ms per decode step" in text


def test_hf_state_dict_covers_transformers_model(tiny_models):
    """Every transformers parameter gets kiln's weight (the baseline compares the same model)."""
    from engine.config.settings import EngineSettings
    from engine.runtime.llm_engine import LLMEngine

    for arch in ("qwen2", "qwen3"):  # biases, q/k norms, tied embeddings
        engine = LLMEngine.from_settings(
            EngineSettings(
                model=str(tiny_models[arch]),
                device="cpu",
                enforce_eager=True,
                num_gpu_blocks=8,
                max_model_len=64,
                kv_cache_dtype="float32",
            )
        )
        hf = latency.build_hf_model(engine)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        from engine.layers.attention.base import AttentionMetadata

        meta = AttentionMetadata(
            slot_mapping=torch.arange(16, 21),
            query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
            seq_lens=torch.tensor([5], dtype=torch.int32),
            block_tables=torch.tensor([[1]], dtype=torch.int32),
            max_query_len=5,
            max_seq_len=5,
        )
        with torch.inference_mode():
            model = engine.core.model
            ours = model.compute_logits(model(ids[0], torch.arange(5), engine.core.kv_cache.tensor, meta))
            theirs = hf(ids).logits[0].float()
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset,billions", [("llama-3.2-1b", 1.236), ("llama-3.1-8b", 8.030)])
def test_presets_config_only(tmp_path, preset, billions):
    """`make-tiny-model --preset --config-only` gives a loadable config of the real model's size."""
    from engine.models.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / preset, preset=preset, config_only=True)
    assert not list(path.glob("*.safetensors"))
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 16)
    params = sum(p.numel() for p in model.parameters())
    assert abs(params / 1e9 - billions) < 0.01
