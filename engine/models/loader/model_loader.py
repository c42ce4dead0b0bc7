"""Build a model and fill its weights: from HF safetensors (single or sharded), or random (dummy)."""

from __future__ import annotations

import json
import logging
import math
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from engine.distributed.parallel import TensorParallel
from engine.layers.attention.layer import local_heads
from engine.layers.quant import moe as quant_moe
from engine.layers.quant.config import QuantConfig, forced, from_hf
from engine.models.config import ModelConfig
from engine.models.glm import hf_weight_name
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import convert, fast_tokenizer, gguf_file, gguf_quant
from engine.models.loader import quant_loading as quant_loading
from engine.models.loader.kv_scales import is_kv_scale_name
from engine.models.loader.load_progress import LoadProgress
from engine.models.loader.safetensors_reader import DTYPE_BYTES, SafetensorsFile
from engine.models.sharding import first_kv_head, vocab_rows_per_rank

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (kiln parameter, slice index within a fused parameter or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen2-MoE
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
# One expert's matrix (Mixtral: w1 gate, w3 up, w2 down; Qwen-MoE: gate/up/down_proj) -> its
# place in the stacked w13 [E, 2I, H] (half 0: gate, 1: up) or w2 [E, H, I].
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {
    "w1": ("w13", 0),
    "gate_proj": ("w13", 0),
    "w3": ("w13", 1),
    "up_proj": ("w13", 1),
    "w2": ("w2", None),
    "down_proj": ("w2", None),
}
# Checkpoints written with the experts already stacked (transformers 5's in-memory layout).
_STACKED = {
    "mlp.experts.gate_up_proj": "mlp.w13",
    "mlp.experts.down_proj": "mlp.w2",
    "block_sparse_moe.experts.gate_up_proj": "mlp.w13",
    "block_sparse_moe.experts.down_proj": "mlp.w2",
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {model_dir}")
    return files


def _fused_slices(model: LlamaForCausalLM, kiln_name: str) -> list[slice]:
    if kiln_name.endswith("qkv_proj"):  # (this rank's heads under tp)
        attn = model.get_submodule(kiln_name.rsplit(".", 1)[0])
        q, kv = attn.q_size, attn.kv_size
        return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)]
    f = model.get_submodule(kiln_name).out_features // 2  # gate rows, then up rows
    return [slice(0, f), slice(f, 2 * f)]


Index = tuple[int | slice, ...]


def _target(model: LlamaForCausalLM, hf_name: str) -> tuple[str, Index | None] | None:
    """Map an HF tensor name to (kiln parameter name, the part of it the tensor fills: rows of a
    fused parameter, or an expert's slot in a stacked one; None for the whole)."""
    hf_name = hf_weight_name(hf_name, model.config.model_type)  # GLM's own names (engine/models/glm.py)
    if not hf_name.startswith(("model.", "lm_head.")):
        hf_name = "model." + hf_name  # a bare model's checkpoint (AutoModel): no "model." prefix
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        return ("lm_head.weight", None) if model.lm_head is not None else None
    if is_kv_scale_name(hf_name):
        return None  # the KV cache's scales (engine/models/loader/kv_scales.py), not a layer's weight
    m = _LAYER.match(hf_name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    expert = _EXPERT.match(rest)
    if expert:
        e, (stacked, half) = int(expert.group(1)), _EXPERT_PART[expert.group(2)]
        if half is None:
            return f"layers.{layer}.mlp.{stacked}", (e,)
        rows = model.get_submodule(f"layers.{layer}.mlp").w13.shape[1] // 2  # (this rank's rows under tp)
        return f"layers.{layer}.mlp.{stacked}", (e, slice(half * rows, (half + 1) * rows))
    if rest in _STACKED:
        return f"layers.{layer}.{_STACKED[rest]}", None
    if rest == "block_sparse_moe.gate.weight":  # Mixtral's router
        return f"layers.{layer}.mlp.gate.weight", None
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, idx = _FUSED[module]
        name = f"layers.{layer}.{fused}.{kind}"
        return name, (_fused_slices(model, name.rsplit(".", 1)[0])[idx],)
    if "rotary_emb" in rest:
        return None
    return f"layers.{layer}.{rest}", None


# What a rank reads of a checkpoint tensor under tp: the pieces (index tuples into the tensor),
# concatenated along `dim`, and the tensor's full extent along that dimension (checked).
Source = tuple[list[Index], int, int]
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def _source(model: LlamaForCausalLM, name: str, index: Index | None) -> Source | None:
    """The part of the checkpoint tensor for kiln parameter `name` (filling `index` of it, as
    `_target` says) that this rank reads; None: all of it (no tp, or a replicated weight).
    With index None the tensor has the whole parameter's layout: fused q/k/v or gate/up (GLM),
    stacked experts, or the unsharded model's parameter itself (dummy weights)."""
    tp, cfg = model.tp, model.config
    if tp is None:
        return None
    rank, world = tp.rank, tp.world_size
    module, _, kind = name.rpartition(".")
    if name in _VOCAB:
        rows = vocab_rows_per_rank(cfg, tp)
        start = min(rank * rows, cfg.vocab_size)
        return [(slice(start, min(start + rows, cfg.vocab_size)),)], 0, cfg.vocab_size
    if module.endswith("qkv_proj"):
        heads, kv_heads = local_heads(cfg, tp)
        d = cfg.head_dim
        q = slice(rank * heads * d, (rank + 1) * heads * d)
        kv = slice(first_kv_head(cfg, tp) * d, (first_kv_head(cfg, tp) + kv_heads) * d)
        q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
        if index is None:
            return [(q,), (_shift(kv, q_all),), (_shift(kv, q_all + kv_all),)], 0, q_all + 2 * kv_all
        part = _fused_slices(model, module).index(index[0])
        return [(q if part == 0 else kv,)], 0, q_all if part == 0 else kv_all
    if module.endswith("gate_up_proj"):
        width = model.get_submodule(module).out_features // 2
        mine = slice(rank * width, (rank + 1) * width)
        if index is None:
            return [(mine,), (_shift(mine, width * world),)], 0, 2 * width * world
        return [(mine,)], 0, width * world
    if module.endswith(("o_proj", "down_proj")) and kind == "weight":
        width = model.get_submodule(module).in_features
        return [(slice(None), slice(rank * width, (rank + 1) * width))], 1, width * world
    if name.endswith("mlp.w13"):
        width = model.get_parameter(name).shape[1] // 2
        mine = slice(rank * width, (rank + 1) * width)
        if index is None:  # [E, 2I, H]
            return [(slice(None), mine), (slice(None), _shift(mine, width * world))], 1, 2 * width * world
        return [(mine,)], 0, width * world  # one expert's gate or up [I, H]
    if name.endswith("mlp.w2"):
        width = model.get_parameter(name).shape[2]
        mine = slice(rank * width, (rank + 1) * width)
        if index is None:  # [E, H, I]
            return [(slice(None), slice(None), mine)], 2, width * world
        return [(slice(None), mine)], 1, width * world  # one expert's down [H, I]
    return None


def _read(hf_name: str, shape: tuple[int, ...], read, source: Source | None) -> torch.Tensor:
    """A checkpoint tensor of `shape`, or this rank's pieces of it: read(index) reads part of it
    (a safetensors slice: only those bytes)."""
    if source is None:
        return read((slice(None),))
    pieces, dim, extent = source
    if len(shape) <= dim or shape[dim] != extent:
        raise ValueError(f"model: {hf_name} has shape {tuple(shape)}, expected {extent} along dimension {dim}")
    parts = [read(piece) for piece in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


@quant_loading.heap_returned_while_loading()
def load_model(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    lora: tuple[int, int] | None = None,
    quantization: str | None = None,
    int4_kernel: str = "auto",
    gguf_dequantize: bool = False,
    tp: TensorParallel | None = None,
    quant_activations: str = "auto",
    on_allocated: Callable[[list[torch.Tensor]], None] | None = None,
) -> LlamaForCausalLM:
    """lora: (slots, max rank) to make room for LoRA adapters (engine/lora/adapters.py), or None.
    quantization: the `quantization` setting (None: the checkpoint's own quantization_config).
    tp: this rank's place in a tensor-parallel group: the model is this rank's shard, and only
    this rank's slice of each weight is read from the checkpoint (a GGUF file's tensors are then
    dequantised: quantised blocks are not sliced).
    on_allocated: called with the model's tensors once they are allocated, before any is written,
    and with each buffer the load allocates later (the CPU kernels' packed weights) before it is
    written (the builder advises huge pages there: engine/worker/cpu_huge_pages.py)."""
    if load_format in ("safetensors", "gguf") and gguf_file.is_gguf(model_dir) != (load_format == "gguf"):
        raise ValueError(f"load_format {load_format}: {model_dir} is not a {load_format} checkpoint")
    quant = quant_config(config, quantization, load_format)
    if tp is not None and tp.world_size > 1:
        gguf_dequantize = True
        if quant is not None:
            raise ValueError(
                f"quantization: quantised models ({quant.name}) are not supported with tensor_parallel_size > 1 yet"
            )
        if lora is not None:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor_parallel_size > 1 yet")
    if quant is not None and quant.quantize_at_load and load_format != "dummy" and gguf_file.is_gguf(model_dir):
        raise ValueError("quantization: fp8 at load is for safetensors checkpoints, not GGUF files")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, tp)
        if lora is not None:
            model.enable_lora(*lora)
        if quant is not None:  # (fp8 at load too: each weight is quantised as it is read)
            quant_loading.prepare(model, quant, dtype, int4_kernel, quant_activations)
        gguf_kept = (
            gguf_quant.prepare(
                model, model_dir, lambda n: _target(model, n), dtype, device, int4_kernel, quant_activations
            )
            if quant is None and load_format != "dummy" and gguf_file.is_gguf(model_dir) and not gguf_dequantize
            else {}
        )
        embedding = (
            gguf_quant.embed_from_blocks(model, model_dir, dtype, device, int4_kernel)
            if quant is None and load_format != "dummy" and gguf_file.is_gguf(model_dir) and not gguf_dequantize
            else None
        )
        # (cast while still on meta: to_empty then allocates each tensor once, in its final dtype,
        # not a float32 one converted beside it; issue 40)
        quant_loading.cast_except_quantized(model, dtype)
    model = _allocate(model, device)
    if on_allocated is not None:
        on_allocated([*model.parameters(), *model.buffers()])
    for name, buffer in model.named_buffers():
        if ".lora_" in name:
            buffer.zero_()  # empty slots: no adapter
    for rotary in (model.rotary, model.rotary_local):
        if rotary is not None:
            rotary.cos_sin = rotary.cos_sin.float()
            rotary.fill()
    if load_format == "dummy":
        _init_dummy(model, seed, max_positions)
        quant_loading.init_dummy(model, seed)
    elif gguf_file.is_gguf(model_dir):
        skip = gguf_quant.load(model, model_dir, gguf_kept, dtype, device, on_allocated)
        if embedding is not None:
            gguf_quant.embedding_from_file(model, model_dir, embedding)
            skip.add(embedding.name)
        _load_gguf(model, model_dir, skip)
        if not gguf_dequantize and quant is None:
            gguf_quant.pack_head(model, model_dir, dtype, device, int4_kernel, quant_activations, on_allocated)
    else:
        _load_safetensors(model, model_dir, quant, dtype)
    if quant is not None and quant.quantize_at_load:
        quant_moe.quantize_loaded(
            model.moe_layers(), quant
        )  # MoE experts load dense, then become e4m3 (dense ones only: a peak)
    quant_loading.finish(model, dtype, int4_kernel)  # int4 layers -> the packed int4 kernels' layout
    return model.eval().requires_grad_(False)


def _allocate(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    """Module.to_empty, with empty_strided: to_empty's empty_like of a meta tensor goes through
    torch's Python reference ops, whose first use imports sympy and torch.fx (about 1 s of every
    start: issue 40). Same shapes, strides and dtypes."""
    return model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def quant_config(config: ModelConfig, setting: str | None, load_format: str = "auto") -> QuantConfig | None:
    """The checkpoint's quantization, or the setting's; a setting that contradicts the checkpoint is
    refused. With dummy weights any layout may be forced (random weights of that layout)."""
    own = from_hf(config.quantization) if config.quantization else None
    if setting is None:
        return own
    if own is not None:
        known = {"gptq": "gptq", "awq": "awq", "ct": "compressed-tensors"}.get(own.layout)
        if setting != known:
            raise ValueError(
                f"quantization: the checkpoint is already quantised ({own.name}); "
                f"quantization={setting!r} cannot apply (leave it unset)"
            )
        return own
    return forced(setting, dummy=load_format == "dummy")


def _init_dummy(model: LlamaForCausalLM, seed: int, max_positions: int) -> None:
    """Random weights. A tp shard draws each whole weight, as the unsharded model does, and keeps
    its slice: every rank's shard is then a slice of the same model (tp=2 equals tp=1)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    if model.tp is not None:
        with torch.device("meta"):
            whole = dict(LlamaForCausalLM(model.config, max_positions).named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # unit scale: weight 1, or 0 where the norm adds an offset (Gemma)
            param.data.fill_(1.0 - model.config.norm_weight_offset)
        elif name.endswith("bias"):
            param.data.zero_()
        elif model.tp is None:
            param.data.normal_(0.0, 0.02, generator=gen)
        else:
            full = torch.empty(whole[name].shape, dtype=param.dtype, device=param.device).normal_(
                0.0, 0.02, generator=gen
            )
            part = _read(name, full.shape, full.__getitem__, _source(model, name, None))
            param.data.zero_()  # (vocabulary padding rows)
            param.data[: part.shape[0]].copy_(part)


def load_tokenizer(path: str | Path, cache_dir: Path | None = None):
    """The tokenizer of an HF checkpoint directory (or tokenizer directory), or of a GGUF file
    (converted once, kept under cache_dir if given: engine/models/loader/gguf_cache.py); from kiln's
    fast form where an earlier start kept one (engine/models/loader/fast_tokenizer.py)."""
    if gguf_file.is_gguf(path):
        return gguf_file.load_tokenizer(path, cache_dir)

    def transformers_tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))

    entry = None if cache_dir is None else fast_tokenizer.dir_entry(path, cache_dir)
    return fast_tokenizer.load(entry, transformers_tokenizer, str(path))


class _Filler:
    """Copies checkpoint tensors into the model's parameters, counting what each received. The
    weights of layers quantised at load (--quantization fp8) are quantised as they arrive."""

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.params = dict(model.named_parameters())
        self.at_load = {f"{n}.weight": m for n, m in quant_loading.quantized_at_load(model).items()}
        self.sizes = {n: p.numel() for n, p in self.params.items()}
        self.sizes.update((n, m.out_features * m.in_features) for n, m in self.at_load.items())
        self.seen: dict[str, int] = {}

    def whole_parameter(self, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The parameter a checkpoint tensor of `shape` fills whole, as is (a contiguous CPU tensor a
        reader may write the file's values into, then hand to `put`); None where it is a part, is
        sharded, quantised at load or shaped otherwise."""
        target = _target(self.model, hf_name)
        if target is None or target[1] is not None or target[0] in self.at_load or self.model.tp is not None:
            return None
        param = self.params.get(target[0])
        if param is None or tuple(param.shape) != tuple(shape) or not param.is_cpu or not param.is_contiguous():
            return None
        return param.data

    def put(
        self, hf_name: str, tensor: torch.Tensor | None = None, reader=None, file: SafetensorsFile | None = None
    ) -> None:
        """The whole checkpoint tensor; or a reader of it (a safetensors slice: under tp only this
        rank's part is read); or the file holding it (read straight into its parameter)."""
        target = _target(self.model, hf_name)
        if target is None:
            return
        name, index = target
        if name in self.at_load:
            tensor = file.read(hf_name) if tensor is None else tensor
            quant_loading.quantize_rows_into(
                self.at_load[name], index[0] if index else None, tensor, hf_name, self.dtype
            )
            self.seen[name] = self.seen.get(name, 0) + tensor.numel()
            return
        if name not in self.params:
            raise ValueError(f"model: checkpoint tensor {hf_name} has no place in the model ({name})")
        param = self.params[name]
        dest = param.data if index is None else param.data[index]
        if self.model.tp is not None:
            shape = tuple(tensor.shape) if reader is None else tuple(reader.get_shape())
            tensor = _read(
                hf_name,
                shape,
                tensor.__getitem__ if reader is None else reader.__getitem__,
                _source(self.model, name, index),
            )
            if name in _VOCAB and tensor.shape[0] < dest.shape[0]:  # the last rank's padding rows
                dest[tensor.shape[0] :].zero_()
                self.seen[name] = self.seen.get(name, 0) + dest[tensor.shape[0] :].numel()
                dest = dest[: tensor.shape[0]]
        shape = tuple(tensor.shape) if tensor is not None else file.shape(hf_name)
        if tuple(dest.shape) != shape:
            raise ValueError(f"model: {hf_name} has shape {shape}, expected {tuple(dest.shape)}")
        if tensor is None and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == file.dtype(hf_name):
            file.read_into(hf_name, dest)  # (no copy: the file's bytes land in the parameter)
        elif tensor is not None and tensor.data_ptr() == dest.data_ptr() and tensor.dtype == dest.dtype:
            pass  # (read into the parameter already: whole_parameter)
        else:
            convert.copy_into(dest, file.read(hf_name) if tensor is None else tensor)
        self.seen[name] = self.seen.get(name, 0) + dest.numel()

    def check_complete(self, source: Path) -> None:
        missing = [n for n, size in self.sizes.items() if self.seen.get(n, 0) != size]
        if missing:
            raise ValueError(
                f"model: checkpoint in {source} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )


@torch.no_grad()
def _load_safetensors(
    model: LlamaForCausalLM, model_dir: Path, quant: QuantConfig | None = None, dtype: torch.dtype | None = None
) -> None:
    """quant: the model's quantisation (a quantised checkpoint's layers are filled by engine/layers/quant
    first). Each tensor is read with explicit reads into its parameter (safetensors_reader.py), so
    the file's pages never count in the process's memory; under tp, this rank's slices are read."""
    filler = _Filler(model, dtype)
    files = safetensors_files(model_dir)
    progress = LoadProgress(str(model_dir), sum(file.stat().st_size for file in files), len(files))
    if model.tp is not None:
        for file in files:
            with SafetensorsFile(file) as f:
                for hf_name in f.keys():
                    if _target(model, hf_name) is not None:  # the bar counts the file's bytes gone past
                        reader = f.get_slice(hf_name)
                        filler.put(hf_name, reader=reader)
                        progress.advance(math.prod(reader.get_shape()) * DTYPE_BYTES[reader.get_dtype()])
        progress.finish()
        filler.check_complete(model_dir)
        return
    with ExitStack() as stack:
        opened = [stack.enter_context(SafetensorsFile(file)) for file in files]
        where = {name: f for f in opened for name in f.keys()}
        consumed: set[str] = set()
        if quant is not None and not quant.quantize_at_load:
            consumed = quant_loading.load_quantized(
                model,
                quant,
                list(where),
                lambda n: where[n].read(n),
                lambda n: _target(model, n),
                on_tensor=lambda t: progress.advance(t.nbytes),
            )
        for hf_name, f in where.items():
            if hf_name not in consumed and _target(model, hf_name) is not None:
                filler.put(hf_name, file=f)
                progress.advance(math.prod(f.shape(hf_name)) * f.dtype(hf_name).itemsize)
    progress.finish()
    filler.check_complete(model_dir)


@torch.no_grad()
def _load_gguf(model: LlamaForCausalLM, path: Path, skip: set[str] = frozenset()) -> None:
    """Dequantise a GGUF file's tensors one by one into the model (llama.cpp's --gguf-dequantize);
    skip: those engine/models/loader/gguf_quant.py loaded kept quantised."""
    cfg = model.config
    filler = _Filler(model)
    total = len(gguf_file.read_header(path)[1])
    progress = LoadProgress(str(path), total, 1, unit="tensors")
    for hf_name, tensor in gguf_file.iter_tensors(
        path,
        cfg.num_heads,
        cfg.num_kv_heads,
        gemma_norms=cfg.norm_weight_offset != 0.0,
        sandwich=cfg.sandwich_norms,
        skip=skip,
        into=filler.whole_parameter,
    ):
        filler.put(hf_name, tensor)
        progress.advance(tensor.nbytes)
    progress.loaded_elsewhere(total - progress.tensors)  # (kept quantised: gguf_quant.py loaded them)
    progress.finish()
    filler.check_complete(path)
