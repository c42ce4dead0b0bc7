"""Write tiny quantised checkpoints in each format's exact on-disk layout (test helper), and the
full-precision checkpoint of the same dequantised weights as the reference.

Weights are rounded to the nearest level (RTN) per group; what matters here is the layout, not
the quantiser. Packing is written from each format's definition (see engine/layers/quant/int_formats.py
for the layouts), independently of kiln's unpacking; compressed-tensors checkpoints are packed
and described with the `compressed-tensors` package itself.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn(
    w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> unsigned q [out, in], unsigned zero points [out, G], fp16 scales [out, G]."""
    out, inp = w.shape
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    q = torch.empty(out, inp, dtype=torch.int32)
    zeros = torch.empty(out, groups, dtype=torch.int32)
    scales = torch.empty(out, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols].float()
        if sym:
            s = (wg.abs().amax(dim=1) * 2 / maxq).clamp(min=1e-6)
            z = torch.full((out,), (maxq + 1) // 2, dtype=torch.int32)
        else:
            lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / maxq).clamp(min=1e-6)
            z = torch.round(-lo / s).to(torch.int32).clamp(min_zero, maxq)
        s16 = s.to(torch.float16)
        q[:, cols] = torch.clamp(torch.round(wg / s16.float()[:, None]).to(torch.int32) + z[:, None], 0, maxq)
        zeros[:, g], scales[:, g] = z, s16
    return q, zeros, scales


def dequant(q, zeros, scales, g_idx) -> torch.Tensor:
    g = g_idx.long()
    return (q.float() - zeros.float()[:, g]) * scales.float()[:, g]


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_along(vals: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per = 32 // bits
    v = vals.to(torch.int64).movedim(dim, 0)
    v = v.reshape(v.shape[0] // per, per, *v.shape[1:])
    word = sum(v[:, k] << (bits * k) for k in range(per))
    return _to_int32(word).movedim(0, dim).contiguous()


def pack_awq(vals: torch.Tensor) -> torch.Tensor:
    """[rows, out] nibbles -> int32 [rows, out / 8], AWQ's interleaved order."""
    v = vals.to(torch.int64).reshape(vals.shape[0], -1, 8)
    word = sum(v[:, :, AWQ_ORDER[k]] << (4 * k) for k in range(8))
    return _to_int32(word).contiguous()


def _perms(cfg: dict, seed: int) -> dict[tuple[str, str], torch.Tensor]:
    """Act-order: one column permutation per layer input (q/k/v share one, gate/up another), as
    GPTQ's permutation comes from the shared input's Hessian."""
    gen = torch.Generator().manual_seed(seed)
    h, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    attn_width = heads * (cfg.get("head_dim") or h // heads)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for kind, n in (("attn_in", h), ("o_in", attn_width), ("mlp_in", h), ("down_in", i)):
            out[(str(layer), kind)] = torch.randperm(n, generator=gen)
    return out


def _two_copies(src: Path, out: Path, tag: str) -> tuple[Path, Path]:
    """Directories for the quantised checkpoint and its dequantised twin (config, tokenizer copied)."""
    dirs = out / tag, out / f"{tag}-dequantised"
    for d in dirs:
        shutil.copytree(src, d, dirs_exist_ok=True)
    return dirs


def _quantised(name: str) -> bool:
    return name.endswith(".weight") and (name.rsplit(".", 2)[-2] in _LINEARS or _expert_linear(name))


# Mixture-of-experts checkpoints: every expert's projections (Mixtral's w1/w3 gate/up, w2 down;
# Qwen-MoE's gate/up/down_proj) and Qwen2-MoE's shared expert are quantised; the routers
# (mlp.gate, block_sparse_moe.gate) and shared_expert_gate stay in full precision, as GPTQ/AWQ
# quantisers and llm-compressor's MoE recipes leave them.
_EXPERT_LINEARS = {"w1": "mlp_in", "w3": "mlp_in", "w2": "down_in"}
MOE_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]


def _expert_linear(name: str) -> bool:
    return ".experts." in name and name.rsplit(".", 2)[-2] in _EXPERT_LINEARS


def _input_perm(perms: dict, name: str, inp: int, seed: int) -> torch.Tensor:
    """Act-order permutation of a layer's input: shared per (layer, input) for dense projections;
    per expert (its gate and up share one; down its own) for MoE experts and the shared expert."""
    parts = name.split(".")
    kind = _INPUT_KIND.get(parts[-2]) or _EXPERT_LINEARS[parts[-2]]
    if ".experts." not in name and ".shared_expert." not in name:
        return perms[(parts[2], kind)]
    key = (".".join(parts[:-2]), kind)
    if key not in perms:
        perms[key] = torch.randperm(inp, generator=torch.Generator().manual_seed(seed + 1000 + len(perms)))
    return perms[key]


_INPUT_KIND = {
    "q_proj": "attn_in",
    "k_proj": "attn_in",
    "v_proj": "attn_in",
    "o_proj": "o_in",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
    "down_proj": "down_in",
}


def write_quantized(
    src: Path,
    out: Path,
    fmt: str,
    bits: int = 4,
    group_size: int = 32,
    sym: bool = True,
    act_order: bool = False,
    seed: int = 0,
    keep_dense: str | None = None,
) -> tuple[Path, Path]:
    """fmt: gptq | awq | ct (compressed-tensors pack-quantized). Returns (quantised checkpoint,
    full-precision checkpoint of the dequantised weights). keep_dense (ct): a regex of module
    names left unquantised and added to the ignore list as "re:<regex>"."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    quant_dir, ref_dir = _two_copies(src, out, fmt)
    # compressed-tensors' act-order ("weight") keeps groups contiguous: no g_idx on disk
    grouped_by_perm = act_order and fmt != "ct"
    perms = _perms(cfg, seed) if grouped_by_perm else {}
    qt, ref = {}, {}
    for name, w in tensors.items():
        if not _quantised(name) or (keep_dense and re.match(keep_dense, name.removesuffix(".weight"))):
            qt[name] = ref[name] = w
            continue
        prefix = name.removesuffix(".weight")
        inp = w.shape[1]
        gs = group_size if group_size > 0 else inp
        if grouped_by_perm:
            perm = _input_perm(perms, name, inp, seed)
            g_idx = torch.empty(inp, dtype=torch.int32)
            g_idx[perm] = (torch.arange(inp) // gs).to(torch.int32)
        else:
            g_idx = (torch.arange(inp) // gs).to(torch.int32)
        # GPTQ's v1 format cannot store a zero point of 0 (it stores zero - 1)
        q, z, s = rtn(w, bits, group_size, sym, g_idx, min_zero=1 if fmt == "gptq" else 0)
        ref[name] = dequant(q, z, s, g_idx)
        if fmt == "gptq":
            qt[prefix + ".qweight"] = pack_along(q.t(), bits, 0)  # [in * bits / 32, out]
            qt[prefix + ".qzeros"] = pack_along((z - 1).t() & ((1 << bits) - 1), bits, 1)  # [G, out * bits / 32]
            qt[prefix + ".scales"] = s.t().contiguous()
            qt[prefix + ".g_idx"] = g_idx
        elif fmt == "awq":
            qt[prefix + ".qweight"] = pack_awq(q.t())  # [in, out / 8]
            qt[prefix + ".qzeros"] = pack_awq(z.t())  # [G, out / 8]
            qt[prefix + ".scales"] = s.t().contiguous()
        else:
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            offset = 1 << (bits - 1)
            qt[prefix + ".weight_packed"] = pack_to_int32((q - offset).to(torch.int8), bits)
            qt[prefix + ".weight_scale"] = s
            qt[prefix + ".weight_shape"] = torch.tensor(list(w.shape))
            if not sym:
                qt[prefix + ".weight_zero_point"] = pack_to_int32((z - offset).to(torch.int8), bits, packed_dim=0)

    save_file(qt, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ignore = MOE_IGNORE if any(".experts." in n for n in tensors) else ["lm_head"]
    ignore = ignore + [f"re:{keep_dense}"] if keep_dense else ignore
    qcfg = dict(cfg, quantization_config=_quant_config(fmt, bits, group_size, sym, act_order, ignore))
    (quant_dir / "config.json").write_text(json.dumps(qcfg, indent=2))
    return quant_dir, ref_dir


def _quant_config(
    fmt: str, bits: int, group_size: int, sym: bool, act_order: bool, ignore: list[str] | None = None
) -> dict:
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "sym": sym,
            "desc_act": act_order,
            "checkpoint_format": "gptq",
            "damp_percent": 0.01,
            "true_sequential": True,
        }
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": not sym,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=sym,
        strategy="group" if group_size > 0 else "channel",
        group_size=group_size if group_size > 0 else None,
        actorder="weight" if act_order else None,
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        format="pack-quantized",
        ignore=ignore or ["lm_head"],
        quantization_status="compressed",
    )
    return config.model_dump(mode="json")


@torch.no_grad()
def _calibrate(src: Path, num_prompts: int = 8) -> dict[str, torch.Tensor]:
    """Static activation scales as llm-compressor calibrates them: the largest |input| each linear
    layer sees over some prompts (random token ids here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in _LINEARS:

            def hook(mod, args, name=name):
                amax[name] = torch.maximum(amax.get(name, torch.tensor(0.0)), args[0].abs().max())

            hooks.append(module.register_forward_pre_hook(hook))
    gen = torch.Generator().manual_seed(0)
    for _ in range(num_prompts):
        model(torch.randint(5, model.config.vocab_size, (1, 48), generator=gen))
    for h in hooks:
        h.remove()
    return amax


def write_fp8(
    src: Path, out: Path, weight_strategy: str = "channel", activations: str | None = "dynamic"
) -> tuple[Path, Path]:
    """compressed-tensors float-quantized (FP8 W8A8, or W8A16 with activations None)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    quant_dir, ref_dir = _two_copies(src, out, f"fp8-{weight_strategy}-{activations}")
    fmax = torch.finfo(torch.float8_e4m3fn).max
    qt, ref = {}, {}
    input_amax = _calibrate(src) if activations == "static" else {}
    for name, w in tensors.items():
        if not _quantised(name):
            qt[name] = ref[name] = w
            continue
        prefix = name.removesuffix(".weight")
        amax = w.abs().amax(dim=1, keepdim=True) if weight_strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / fmax).float()
        q = (w / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        qt[name] = q
        qt[prefix + ".weight_scale"] = scale
        ref[name] = q.float() * scale
        if activations == "static":
            qt[prefix + ".input_scale"] = (input_amax[prefix] / fmax).reshape(1)
    save_file(qt, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    acts = (
        None
        if activations is None
        else QuantizationArgs(
            num_bits=8,
            type="float",
            symmetric=True,
            strategy="token" if activations == "dynamic" else "tensor",
            dynamic=activations == "dynamic",
        )
    )
    config = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(
                targets=["Linear"],
                input_activations=acts,
                weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=weight_strategy),
            )
        },
        format="float-quantized",
        ignore=MOE_IGNORE if any(".experts." in n for n in tensors) else ["lm_head"],
        quantization_status="compressed",
    )
    (quant_dir / "config.json").write_text(
        json.dumps(dict(cfg, quantization_config=config.model_dump(mode="json")), indent=2)
    )
    return quant_dir, ref_dir
