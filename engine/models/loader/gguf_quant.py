"""GGUF linear weights kept quantised in memory instead of dequantised at load.

On the CPU (int4_kernel "auto", the kernels built: compiler/kernels/cpu_gemv.py), every block format of
the file's attention and MLP projections stays quantised, float32 and bfloat16 models alike:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, repacked into the weight-streaming kernels'
layout (engine/layers/quant/cpu_packed.py; a fused projection whose parts differ, as in Q4_K_M
files, as one run per format).

Elsewhere (a GPU; the CPU with another int4_kernel, or without the kernels):
  Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m), blocks of 32 -> torch's packed int4 layout
      (int4_packed.py: scale d, zero m + 8 d, group 32), multiplied by its int4 kernels;
  Q8_0 (w = d * q, q signed) -> kiln's int8 layout (int_formats.py: q + 128, zero point 128,
      scale d, group 32), dequantised on the fly by IntWeightMethod;
and the rest dequantised to the model dtype: the K-quants, Q5_0/Q5_1, a fused projection whose
parts have different kinds, and int4 layers torch's kernels cannot take (int4_packed.unsupported:
among them every layer of a float32 model on the CPU; with int4_kernel="reference" every Q4_x
layer, as kiln's unpacked int4 layout has integer zero points and Q4_1's m is not one).
Float tensors, the embeddings and the LM head load dense (kiln quantises only the attention and MLP
projections). On the CPU the LM head is in addition kept in the file's blocks (`pack_head`) for
steps of few rows: at batch 1 a dense float32 head of SmolLM2 (49152 x 576, 113 MB) is read every
step, more than all 30 layers of a Q4_1 file; the dense copy serves the embedding lookups and the
large batches, where the GEMM beats the kernels; where the file's embedding table is itself in
such blocks, that dense copy is not made at all (`embed_from_blocks`: lookups read their rows from the
file, engine/layers/quant/gguf_embedding.py; every logits row goes to the packed head). `gguf_dequantize`
turns all of this off
(llama.cpp's and vLLM's dequantise-at-load behaviour).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from compiler.kernels import cpu_gemv
from engine.layers.linear import Linear
from engine.layers.quant import cpu_packed, int4_packed, int_formats
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.gguf_blocks import BLOCK_TYPES, QK
from engine.layers.quant.gguf_embedding import BlockEmbedding
from engine.layers.quant.linear import IntWeightMethod, attach
from engine.models.loader.gguf_file import TensorInfo, hf_name, read_header, unpermute_rows
from engine.models.loader.safetensors_reader import read_exactly_into

KIND = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}
INT8 = QuantConfig("int", "gguf", 8, QK)

Target = Callable[[str], "tuple[str, tuple | None] | None"]


def prepare(
    model: nn.Module,
    path,
    target: Target,
    dtype: torch.dtype,
    device: torch.device,
    int4_kernel: str = "auto",
    activations: str = "auto",
) -> dict[str, tuple[str, slice | None]]:
    """On the meta-built model: the linear layers whose GGUF tensors are all Q4_x (or all Q8_0)
    lose their dense weight (so it is never allocated) and get the quantised form. Returns
    {GGUF tensor name: (kiln layer name, its rows in the layer or None)} of the tensors to load so."""
    linears = model.quantizable_linears()
    _, tensors = read_header(path)
    parts: dict[str, list[tuple[str, str, slice | None]]] = {}
    for t in tensors:
        name = hf_name(t.name, model.config.sandwich_norms)
        hit = target(name) if name and name.endswith(".weight") else None
        if hit is None or hit[0].removesuffix(".weight") not in linears:
            continue
        layer = hit[0].removesuffix(".weight")
        parts.setdefault(layer, []).append((t.name, BLOCK_TYPES[t.type_id][0], hit[1][0] if hit[1] else None))
    plan: dict[str, tuple[str, slice | None]] = {}
    cpu = int4_kernel == "auto" and cpu_packed.usable(device)
    for layer, items in parts.items():
        module = linears[layer]
        if cpu:
            if not all(kind in cpu_gemv.GGUF_FORMATS for _, kind, _ in items):
                continue
            del module.weight
            module.register_parameter("weight", None)
            module.quant = cpu_packed.CpuPackedMethod(cpu_packed.float_acts_for(dtype, activations))  # (buffers: load)
            plan.update({gguf: (layer, rows) for gguf, _, rows in items})
            continue
        kinds = {KIND.get(kind) for _, kind, _ in items}
        if len(kinds) != 1 or None in kinds:
            continue
        kind = kinds.pop()
        if kind == "int4":
            kernel = int4_packed.kernel_dtype(dtype, int4_kernel)
            if int4_kernel == "reference" or int4_packed.unsupported(
                module.out_features, module.in_features, 4, QK, device, kernel
            ):
                continue
            del module.weight
            module.register_parameter("weight", None)
            for buf in int4_packed.BUFFERS:  # filled once every part is loaded (load)
                module.register_buffer(buf, None)
            module.int4_group = QK
            module.int4_kernel_dtype = kernel  # (load: the dtype of its scales and zeros)
            module.quant = int4_packed.PACKED
        else:
            attach(module, IntWeightMethod(INT8), "meta")
        plan.update({gguf: (layer, rows) for gguf, _, rows in items})
    return plan


EMBEDDING = "token_embd.weight"


def embed_from_blocks(
    model: nn.Module, path, dtype: torch.dtype, device: torch.device, int4_kernel: str = "auto"
) -> TensorInfo | None:
    """On the meta-built model, where `pack_head` will hold the file's LM head in the kernels'
    layout: give it an embedding that reads the file's blocks (BlockEmbedding, pointed at the file by
    `embedding_from_file` once the model is allocated) instead of a dense table. Returns the file's embedding tensor, or
    None where the dense table stays (floats in the file, LoRA, tensor parallel, no CPU kernels)."""
    if int4_kernel != "auto" or getattr(model, "tp", None) is not None or model.lora_slots:
        return None
    if not cpu_packed.usable(device):
        return None
    _, tensors = read_header(path)
    by_name = {t.name: t for t in tensors}
    t = by_name.get(EMBEDDING)
    cfg = model.config
    if t is None or BLOCK_TYPES[t.type_id][0] not in cpu_gemv.GGUF_FORMATS:
        return None
    if t.shape != (cfg.vocab_size, cfg.hidden_size):
        return None
    head = by_name.get("output.weight", t)  # (tied: the embedding is the head)
    if model.lm_head is None and BLOCK_TYPES[head.type_id][0] not in cpu_gemv.GGUF_FORMATS:
        return None  # (pack_head would not make the head the dense table was)
    model.embed_tokens = BlockEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
    return t


def embedding_from_file(model: nn.Module, path, t: TensorInfo) -> None:
    model.embed_tokens.read_from(path, t.offset, t.nbytes, t.type_id)


def _affine_int4(raw: torch.Tensor, kind: str, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 bytes -> (q uint8 [rows, K], scale, offset float32 [rows, K / 32]): w = q * scale + offset."""
    size = BLOCK_TYPES[{"Q4_0": 2, "Q4_1": 3}[kind]][2]
    b = raw.reshape(rows, -1, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if kind == "Q4_0":
        m, qs = -8 * d, b[..., 2:]
    else:
        m, qs = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1), b[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, -1)  # value j: low nibble of byte j, then high
    return q, d, m


def _int8(raw: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes -> (unsigned q uint8 [rows, K] = q + 128, scale float32 [rows, K / 32])."""
    b = raw.reshape(rows, -1, 34)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    q = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(rows, -1)
    return q, d


@torch.no_grad()
def load(
    model: nn.Module,
    path,
    plan: dict[str, tuple[str, slice | None]],
    dtype: torch.dtype,
    device: torch.device,
    on_allocated: Callable[[list[torch.Tensor]], None] | None = None,
) -> set[str]:
    """Fill the layers `prepare` made quantised from the file's raw blocks. Returns the GGUF tensor
    names it consumed (the rest load dequantised as before). on_allocated: called with each new
    packed buffer before it is written (cpu_packed.gguf_runs)."""
    if not plan:
        return set()

    linears = model.quantizable_linears()
    meta, tensors = read_header(path)
    permuted = meta.get("general.architecture") == "llama"
    cfg = model.config
    staged: dict[str, list] = {}
    with open(path, "rb") as f:
        for t in tensors:
            if t.name not in plan:
                continue
            layer, rows = plan[t.name]
            module = linears[layer]
            f.seek(t.offset)
            raw = torch.empty(t.nbytes, dtype=torch.uint8)  # (read in place: no bytes object and copy of it)
            if not read_exactly_into(f, raw):
                raise ValueError(f"gguf: {path} ends inside tensor {t.name}")
            kind = BLOCK_TYPES[t.type_id][0]
            out = t.shape[0]
            heads = cfg.num_heads if "attn_q." in t.name else cfg.num_kv_heads if "attn_k." in t.name else 0
            start = rows.start if rows is not None else 0
            if isinstance(module.quant, cpu_packed.CpuPackedMethod):  # the file's blocks, repacked per layer
                raw = raw.reshape(out, -1)
                if permuted and heads:  # (whole rows of blocks: llama.cpp's rotary row order undone)
                    raw = unpermute_rows(raw, heads)
                staged.setdefault(layer, []).append((start, kind, raw))
                if sum(p[2].shape[0] for p in staged[layer]) == module.out_features:
                    runs, packed = cpu_packed.gguf_runs(
                        sorted(staged.pop(layer), key=lambda p: p[0]), module.in_features, on_allocated
                    )
                    cpu_packed.install(module, runs, packed, None, module.quant.float_acts)
                continue
            if KIND[kind] == "int4":
                vals = list(_affine_int4(raw, kind, out))
            else:
                vals = list(_int8(raw, out))
            if permuted and heads:  # llama.cpp's rotary row order, undone on the rows of each part
                vals = [unpermute_rows(v, heads) for v in vals]
            if KIND[kind] == "int8":
                q, d = vals
                sl = slice(start, start + out)
                module.qweight[sl] = q.to(module.qweight.device)
                module.zeros[sl] = 128
                module.scales[sl] = d.to(module.scales.device)
                continue
            staged.setdefault(layer, []).append((start, *vals))
            if sum(p[1].shape[0] for p in staged[layer]) == module.out_features:
                _install_int4(module, sorted(staged.pop(layer), key=lambda p: p[0]), dtype, device)
    if staged:
        raise ValueError(f"gguf: quantised layers {sorted(staged)[:4]} did not receive all their rows")
    return set(plan)


@torch.no_grad()
def pack_head(
    model: nn.Module,
    path,
    dtype: torch.dtype,
    device: torch.device,
    int4_kernel: str = "auto",
    activations: str = "auto",
    on_allocated: Callable[[list[torch.Tensor]], None] | None = None,
) -> bool:
    """On the CPU with the kernels: give `model` a `packed_head` holding the file's LM head (its
    output.weight, or token_embd.weight when tied) in the kernels' layout, for compute_logits at
    few rows. Returns whether it did (not when the head is stored as floats). on_allocated: called
    with the packed buffer before it is written."""
    if int4_kernel != "auto" or getattr(model, "tp", None) is not None or not cpu_packed.usable(device):
        return False
    _, tensors = read_header(path)
    by_name = {t.name: t for t in tensors}
    t = by_name.get("output.weight", by_name.get("token_embd.weight"))
    kind = BLOCK_TYPES[t.type_id][0] if t is not None else None
    if kind not in cpu_gemv.GGUF_FORMATS or t.shape != (model.config.vocab_size, model.config.hidden_size):
        return False
    vocab, hidden = t.shape
    fmt = cpu_gemv.GGUF_FORMATS[kind]
    packed = _pack_in_chunks(path, t, fmt, on_allocated)
    with torch.device("meta"):
        head = Linear(hidden, vocab, False)
    cpu_packed.install(head, [(0, vocab, fmt, 0)], [packed], None, cpu_packed.float_acts_for(dtype, activations))
    model.packed_head = head
    return True


PACK_CHUNK_ROWS = 4096  # rows of the file read and packed at a time (a whole number of the layout's row groups)


def _pack_in_chunks(
    path, t: TensorInfo, fmt: int, on_allocated: Callable[[list[torch.Tensor]], None] | None = None
) -> torch.Tensor:
    """A GGUF tensor [rows, K] of blocks -> the kernels' packed layout, read and packed
    PACK_CHUNK_ROWS rows at a time, each chunk straight into its row groups of the packed tensor:
    the packed tensor and one chunk of the file in memory, not the tensor's raw bytes beside its
    packed copy (a 128k-vocabulary Q6_K head: 215 MB)."""
    rows, k = t.shape
    row_bytes = t.nbytes // rows
    raw = torch.empty(min(rows, PACK_CHUNK_ROWS), row_bytes, dtype=torch.uint8)
    packed = torch.empty(cpu_gemv.packed_shape(fmt, rows, k), dtype=torch.uint8)
    if on_allocated is not None:
        on_allocated([packed])
    with open(path, "rb") as f:
        f.seek(t.offset)
        for first in range(0, rows, PACK_CHUNK_ROWS):
            part = raw[: min(PACK_CHUNK_ROWS, rows - first)]
            if not read_exactly_into(f, part):
                raise ValueError(f"gguf: {path} ends inside tensor {t.name}")
            at = first // cpu_packed.ROW_GROUP
            groups = -(-part.shape[0] // cpu_packed.ROW_GROUP)
            cpu_gemv.pack(part, fmt, k, out=packed[at : at + groups])
    return packed


def _install_int4(module: nn.Module, parts: list, dtype: torch.dtype, device: torch.device) -> None:
    q = torch.cat([p[1] for p in parts])
    scale, offset = torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts])
    sz = int4_packed.scales_and_zeros(
        scale, offset, QK, module.in_features, getattr(module, "int4_kernel_dtype", dtype)
    ).to(device)
    int4_packed.install(module, int4_packed.convert(int_formats.pack_nibbles(q), None, device), sz, None, QK)
