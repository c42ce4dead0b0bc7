"""Memory of a loaded model (issue 40: one copy of each weight): an engine over a bfloat16
safetensors checkpoint holds about the file's bytes more than before it started, not two copies
(oneDNN's packed GEMM copies, a float32 skeleton converted beside the weights)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.runtime.startup_phase import resident_memory
from engine.worker.cpu_gemm_weights import packed_copy_bytes

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, vocab_size=16384)


def _random_bf16_checkpoint(out: Path) -> int:
    """A Llama-shaped checkpoint of random bf16 weights (about 270 MB); returns its file's bytes."""
    from engine.models.tiny_model import make_tiny_model

    make_tiny_model(out, arch="llama", config_only=True, overrides=dict(SHAPE, torch_dtype="bfloat16"))
    cfg = json.loads((out / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h), "model.norm.weight": rand(h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for name, shape in (
            ("self_attn.q_proj", (q, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, q)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ):
            weights[p + name + ".weight"] = rand(*shape)
        weights[p + "input_layernorm.weight"] = rand(h)
        weights[p + "post_attention_layernorm.weight"] = rand(h)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return (out / "model.safetensors").stat().st_size


def _reset_peak() -> bool:
    """Start VmHWM over from the RSS now (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def test_bf16_engine_holds_one_copy_of_its_weights(tmp_path, tiny_llama):
    from engine.entrypoints.llm import LLM
    from tests.support.engine import assert_engine_clean

    if resident_memory() is None or not _reset_peak():
        pytest.skip("needs /proc's VmRSS / VmHWM and clear_refs")
    file_bytes = _random_bf16_checkpoint(tmp_path / "model")
    # (a tiny engine first: the modules and kernels every engine loads are not the weights' memory)
    warm = LLM(str(tiny_llama), device="cpu", dtype="bfloat16", max_model_len=64)
    del warm
    gc.collect()
    _reset_peak()
    before, _ = resident_memory()
    # (cpu_gemm_packed_weights=off: the small model's copy would be kept by `auto`; the copies are
    # bounded by the choice's own test, tests/worker/test_cpu_gemm_weights.py)
    llm = LLM(
        str(tmp_path / "model"),
        device="cpu",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=2,
        cpu_gemm_packed_weights="off",
    )
    _, peak = resident_memory()
    grown = peak - before
    copies = packed_copy_bytes(llm.engine.core.model)  # (a second copy kept on purpose, and reported)
    # one copy of the weights, and what the engine reports beside them; unreported copies (the packed
    # GEMM copies a 1B model kept before issue 40, a float32 skeleton) would be 2.0x
    assert grown <= 1.2 * file_bytes + copies, (
        f"loading grew the peak RSS by {grown / 1e6:.0f} MB for a {file_bytes / 1e6:.0f} MB file "
        f"and {copies / 1e6:.0f} MB of reported copies"
    )
    out = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert out[0].outputs[0].token_ids
    assert_engine_clean(llm.engine)
