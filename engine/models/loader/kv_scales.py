"""An fp8 KV cache's per-layer K/V scales from a checkpoint.

What quantizers write next to the weights (kiln reads each; a scale x means a cache element e
stands for e * x):
- `model.layers.N.self_attn.k_scale` / `.v_scale` (vLLM, llm-compressor and compressed-tensors
  with a `kv_cache_scheme`, ModelOpt);
- `model.layers.N.self_attn.kv_scale`: one scale for both (older AutoFP8 checkpoints);
- `model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale` (older
  compressed-tensors): the scale of the projection's output, which is what the cache stores.
A scale with several elements (per head) is reduced to its largest: kiln keeps one per layer,
and the largest never saturates a value the checkpoint's scales would not.
The model loader skips these tensors (`is_kv_scale_name`); `q_scale` / `prob_scale` (FP8
attention inputs, which kiln does not do) are skipped too.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from engine.models.loader.safetensors_reader import SafetensorsFile

logger = logging.getLogger(__name__)

_SCALE = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?"
    r"(k_scale|v_scale|kv_scale|q_scale|prob_scale|[kqv]_proj\.output_scale)$"
)
# Which of (K, V) each name sets; q_scale, prob_scale and q_proj.output_scale set neither.
_SETS = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1), "k_proj.output_scale": (0,), "v_proj.output_scale": (1,)}


def is_kv_scale_name(hf_name: str) -> bool:
    """A checkpoint tensor that belongs to the KV cache (or to FP8 attention), not to a layer."""
    return _SCALE.match(hf_name) is not None


def read_kv_scales(files: list[Path], num_layers: int) -> torch.Tensor | None:
    """[num_layers, 2] float32 K/V scales from safetensors files, or None when they hold none.
    Layers the checkpoint gives no scale keep 1 (with a warning)."""
    scales = torch.full((num_layers, 2), float("nan"))
    found = False
    for path in files:
        with SafetensorsFile(path) as f:
            for name in f.keys():
                m = _SCALE.match(name)
                if m is None or m.group(2) not in _SETS:
                    continue
                layer = int(m.group(1))
                if layer >= num_layers:
                    raise ValueError(f"kv scales: {path.name} has {name} but the model has {num_layers} layers")
                t = f.read(name).float()
                if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
                    raise ValueError(f"kv scales: {path.name}: {name} must hold finite positive values, got {t}")
                if t.numel() > 1:
                    logger.warning(
                        "kv scales: %s has %d values; kiln keeps one scale per layer (their largest)", name, t.numel()
                    )
                for which in _SETS[m.group(2)]:
                    scales[layer, which] = t.max()
                found = True
    if not found:
        return None
    missing = int(torch.isnan(scales).any(dim=1).sum())
    if missing:
        logger.warning(
            "kv scales: %d of %d layers have no K or V scale in the checkpoint: those use 1.0", missing, num_layers
        )
    return torch.nan_to_num(scales, nan=1.0)
