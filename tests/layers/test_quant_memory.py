"""Loading a quantised model never materialises the bf16 model: peak resident memory while loading
stays under 1.5x the quantised model's size, for int4 checkpoints (GPTQ and compressed-tensors
layouts) and for --quantization fp8 from a bf16 checkpoint (each weight quantised as it is read).

Shape: a scaled-down Llama (hidden 2048, intermediate 5632, 4 layers, 16 q / 4 kv heads, vocab
4096: 180M linear weights, 0.39 GB in bf16) so the test writes and loads in seconds; the 8B shape
is measured by `kiln bench latency --preset llama-3.1-8b --quantization gptq --load-only`
(benchmarks/2026-11-30.md, quantload). The quantised size is the whole loaded model's bytes (parameters and
buffers, the bf16 embeddings and LM head included). The load runs in a fresh subprocess; its
peak RSS (VmHWM, reset just before) is compared with its RSS before load_model (after a small
checkpoint's load did the imports), so the interpreter, torch and lazily imported modules do not
count. VmHWM counts file-backed pages too: a loader that maps the checkpoint pays for what it reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
SMALL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
GROUP = 128
QUANT_CONFIGS = {
    "gptq": dict(quant_method="gptq", bits=4, group_size=GROUP, sym=True, desc_act=False),
    "ct": dict(
        quant_method="compressed-tensors",
        format="pack-quantized",
        ignore=["lm_head"],
        config_groups={
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP},
            }
        },
    ),
}


def _random_words(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)


def write_checkpoint(out: Path, cfg: dict, layout: str) -> None:
    """A checkpoint with random contents in `layout`: "gptq" or "ct" (int4, group 128, random packed
    words: the layout, not a quantiser, matters here) or "bf16" (a dense checkpoint)."""
    gen = torch.Generator().manual_seed(0)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (f, h),
        "mlp.up_proj": (f, h),
        "mlp.down_proj": (h, f),
    }
    t = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=gen).bfloat16() * 0.02,
        "lm_head.weight": torch.randn(v, h, generator=gen).bfloat16() * 0.02,
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        t[pre + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[pre + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name, (o, i) in shapes.items():
            p = pre + name
            if layout == "bf16":
                t[p + ".weight"] = (torch.randn(o, i, generator=gen) * 0.02).bfloat16()
            elif layout == "gptq":
                t[p + ".qweight"] = _random_words(gen, i // 8, o)
                t[p + ".qzeros"] = torch.full((i // GROUP, o // 8), 0x77777777, dtype=torch.int32)  # zero 8 (v1: 7)
                t[p + ".scales"] = torch.full((i // GROUP, o), 0.01, dtype=torch.float16)
                t[p + ".g_idx"] = (torch.arange(i) // GROUP).to(torch.int32)
            else:  # compressed-tensors pack-quantized
                t[p + ".weight_packed"] = _random_words(gen, o, i // 8)
                t[p + ".weight_scale"] = torch.full((o, i // GROUP), 0.01, dtype=torch.bfloat16)
                t[p + ".weight_shape"] = torch.tensor([o, i])
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    extra = {} if layout == "bf16" else {"quantization_config": QUANT_CONFIGS[layout]}
    (out / "config.json").write_text(json.dumps({**cfg, **extra}))


MEASURE = """
import json, sys, torch
from pathlib import Path
from engine.models.config import ModelConfig
from engine.models.loader.model_loader import load_model
d, small, quantization = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] or None
load_model(small, ModelConfig.from_dir(small), torch.bfloat16, torch.device("cpu"), 64,
           quantization=quantization)  # (lazy imports)
cfg = ModelConfig.from_dir(d)
def status(key):  # kB -> bytes
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
model = load_model(d, cfg, torch.bfloat16, torch.device("cpu"), 64, quantization=quantization)
peak = status("VmHWM")
size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
linear = sum(m.in_features * m.out_features for n, m in model.named_modules()
             if hasattr(m, "int4_packed") or hasattr(m, "weight_fp8") or hasattr(m, "gemv_packed0"))
print(json.dumps(dict(growth=peak - before, quantized=size, linear_params=linear,
                      bf16=cfg.num_parameters() * 2)))
"""


@pytest.mark.parametrize("layout,quantization,bf16_over", [("gptq", "", 2.5), ("ct", "", 2.5), ("bf16", "fp8", 1.5)])
def test_quantized_load_peak_rss_under_1_5x(layout, quantization, bf16_over, tmp_path):
    ckpt = tmp_path / f"{layout}-2048"
    write_checkpoint(ckpt, CONFIG, layout)
    small = tmp_path / f"{layout}-256"  # loaded first, so that imports done on the way are not counted
    write_checkpoint(small, {**CONFIG, **SMALL}, layout)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(ckpt), str(small), quantization],
        capture_output=True,
        text=True,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"{layout} {quantization}: quantised {r['quantized'] / 1e6:.0f} MB, bf16 {r['bf16'] / 1e6:.0f} MB, "
        f"peak RSS growth while loading {r['growth'] / 1e6:.0f} MB = {r['growth'] / r['quantized']:.2f}x "
        "the quantised size"
    )
    assert r["linear_params"] == 4 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 5632)  # every layer quantised
    assert r["bf16"] > bf16_over * r["quantized"]  # so a bf16 copy of the model could not hide under the bound
    assert 0 < r["growth"] < 1.5 * r["quantized"]
