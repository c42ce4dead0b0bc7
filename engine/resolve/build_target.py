"""The model directory, device and dtype an engine is built for, resolved from the settings'
strings, the model's config and (on the CPU) which float math this CPU runs fast."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from engine.layers.quant.gguf_blocks import BLOCK_TYPES
from engine.models.config import ModelConfig
from engine.models.loader.gguf_file import is_gguf, read_header
from engine.models.tiny_model import default_model_dir
from engine.worker.cpu_dtype import cpu_auto_dtype, cpu_math

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available")
    return torch.device(name)


def checkpoint_dtype(model_dir: Path, model_config: ModelConfig) -> str | None:
    """The weights' own dtype: float32 / bfloat16 / float16, "quantized" (integer weights: a
    quantization_config, or a GGUF file whose layers are Q8_0, Q4_x, K-quants...), or None."""
    if model_config.quantization:
        return "quantized"
    if is_gguf(model_dir):
        kinds = Counter(
            BLOCK_TYPES.get(t.type_id, ("?",))[0]
            for t in read_header(model_dir)[1]
            if t.name.startswith("blk.") and len(t.shape) == 2
        )
        if not kinds:
            return None
        kind = kinds.most_common(1)[0][0]
        return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(kind, "quantized")
    return model_config.torch_dtype if model_config.torch_dtype in DTYPES else None


def resolve_dtype(
    name: str, model_config: ModelConfig, device: torch.device, model_dir: Path | None = None
) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":  # the fastest exact-enough dtype on this CPU (engine/worker/cpu_dtype.py)
        math = cpu_math()
        checkpoint = checkpoint_dtype(model_dir, model_config) if model_dir is not None else model_config.torch_dtype
        chosen, why = cpu_auto_dtype(checkpoint if checkpoint in (*DTYPES, "quantized") else None, math)
        logger.info("dtype auto on the CPU: %s (%s; %s)", chosen, why, math.describe())
        return DTYPES[chosen]
    native = model_config.torch_dtype
    if native in ("bfloat16", "float16"):
        return DTYPES[native]
    return torch.bfloat16


def resolve_model_dir(model: str | None, cache_dir: Path) -> Path:
    """The checkpoint directory or .gguf file the `model` setting names; none: the tiny test model
    made (once) under cache_dir."""
    if model is None:
        return default_model_dir(cache_dir)
    path = Path(model).expanduser()
    if not path.is_dir() and not is_gguf(path):
        raise ValueError(
            f"model: {model!r} is neither a directory nor a .gguf file (kiln loads HF "
            "checkpoint directories and GGUF files from disk; no model hub is used)"
        )
    return path
