"""The decode-graph tests' model, targets and settings (tests/worker/test_cuda_graph.py), shared
with the GPU tests of speculative decoding under graphs (tests/spec_decode/test_spec_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config.settings import EngineSettings

SIZES = [1, 2, 4, 8, 16]
MAX_MODEL_LEN = 512
# bf16 logits are rounded to 8 bits of mantissa and the compiled kernels fuse/reassociate:
# allowed |graph - eager| is this share of the largest |logit| (plus a small absolute floor).
REL_TOL = 0.03
# Greedy tokens may differ only where the eager top-2 logprobs are this close.
NEAR_TIE = 0.15
MAX_STEPS = 400


def make_model(root) -> str:
    """Tiny random Llama checkpoint with head_dim 64 (peaked logits: initializer_range 0.2)."""
    import transformers

    from engine.models.tiny_model import tiny_config, train_tokenizer

    tok = train_tokenizer()
    tok.save_pretrained(root)
    raw = tiny_config("llama", len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    raw.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root, safe_serialization=True)
    return str(root)


# Target -> (device, dtype, attention backend, kernel settings). "cutlass_v2": the newer kernel
# generations (decode_kernel v2, prefill_kernel wgmma).
TARGETS = {
    "cpu": ("cpu", "float32", "torch", {}),
    "torch": ("cuda", "bfloat16", "torch", {}),
    "cutlass_v1": ("cuda", "bfloat16", "cutlass", {}),
    "cutlass_v2": ("cuda", "bfloat16", "cutlass", dict(decode_kernel="v2", prefill_kernel="wgmma")),
}


def settings(model: str, target: str, cache, *, overlap: bool, **kw) -> EngineSettings:
    """A GPU's defaults as far as the tests need them (graph buckets, chunked prefill at a 512-token
    budget) with async_scheduling always given explicitly: its default differs between devices."""
    device, dtype, backend, kernels = TARGETS[target]
    base = dict(
        model=model,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        max_num_seqs=SIZES[-1],
        cuda_graph_sizes=SIZES,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks=600,
        block_size=16,
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        async_scheduling=overlap,
        **kernels,
    )
    if device == "cuda":
        base["compile_cache_dir"] = cache  # (on the CPU: the session's cache, where the C++ decode is built once)
    base.update(kw)
    return EngineSettings(**base)


def skip_unless_kernels_built(model: str, target: str, cache) -> None:
    from engine.layers.attention.base import BackendSpec
    from engine.layers.attention.cutlass_backend import cutlass_available

    kernels = TARGETS[target][3]
    s = settings(model, target, cache, overlap=False)
    spec = BackendSpec(
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        head_dim=64,
        block_size=16,
        kernel_cache_dir=s.resolved_kernel_cache_dir(),
        **kernels,
    )
    if not cutlass_available(spec):
        pytest.skip(
            f"cutlass kernels {kernels or 'v1/mma'} for bf16/head_dim 64/block 16 are not built (kiln build-kernels)"
        )
