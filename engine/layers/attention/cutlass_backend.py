"""The `cutlass` attention backend: kiln's AOT-built CUTLASS/CuTe kernels (CUDA only).

Kernels are loaded from the build cache (`kiln build-kernels`) in the constructor, only the
generation the settings chose (decode_kernel, prefill_kernel); the backend owns them (their
scratch goes with it) and never compiles. Forward = write_kv_cutlass then
paged_attention_cutlass, both opaque custom ops (safe inside torch.compile(fullgraph=True)
and CUDA graphs). The cubins are sm_90a only (Hopper: H100, H200).
"""

from __future__ import annotations

import torch

from engine.layers.attention.base import AttentionMetadata, BackendSpec
from engine.layers.kv_cache import KVScales

KERNEL_ARCH = (9, 0)  # the cubins are built for sm_90a and carry no PTX for other GPUs


def _required(spec: BackendSpec) -> list[str]:
    from compiler.kernels.manifest import attention_variant_names

    return list(
        attention_variant_names(
            spec.dtype, spec.head_dim, spec.block_size, spec.decode_kernel, spec.prefill_kernel, spec.kv_cache_dtype
        ).values()
    )


def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def cutlass_unavailable_reason(spec: BackendSpec) -> str | None:
    """Why the cutlass backend cannot serve this spec (None: it can): no CUDA, a GPU other than
    sm_90, cuda-python missing, a model feature the kernels lack, or kernels not built."""
    if spec.device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    cap = _capability(spec.device)
    if cap != KERNEL_ARCH:
        return f"the GPU is sm_{cap[0]}{cap[1]}, kiln's cutlass kernels are built for sm_90a only (H100/H200)"
    if spec.windowed_or_capped:
        return "the model has sliding-window or soft-capped attention, which kiln's kernels do not do"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError as e:
        return f"cuda-python is not installed ({e})"
    try:
        from compiler.kernels.loader import KernelLibrary

        KernelLibrary(spec.kernel_cache_dir, _required(spec))
    except Exception as e:  # noqa: BLE001 - any failure means "not available": auto falls back to torch
        return str(e).splitlines()[0]
    return None


def cutlass_available(spec: BackendSpec) -> bool:
    """CUDA sm_90 present, cuda-python importable, and this shape's kernels built in the cache."""
    return cutlass_unavailable_reason(spec) is None


class CutlassAttentionBackend:
    name = "cutlass"

    def __init__(self, spec: BackendSpec):
        cap = _capability(spec.device)
        if cap != KERNEL_ARCH:
            raise RuntimeError(
                f"attention_backend=cutlass: the GPU is sm_{cap[0]}{cap[1]}; kiln's cutlass kernels "
                "are built for sm_90a only (H100/H200): use attention_backend=torch or auto"
            )
        if spec.windowed_or_capped and spec.compile:
            # Those layers would run the reference inside the captured decode graphs, over
            # max_model_len positions per sequence: refuse rather than serve that slowly.
            raise ValueError(
                "attention_backend=cutlass: the model has sliding-window or soft-capped attention, "
                "which kiln's kernels do not do; use attention_backend=torch (auto picks it) or "
                "enforce_eager"
            )
        from compiler.kernels.cutlass_ops import AttentionKernels

        self.spec = spec
        # Raises MissingKernelError (naming `kiln build-kernels --variants ...`) if not built.
        self.kernels = AttentionKernels(
            spec.kernel_cache_dir,
            spec.device,
            spec.dtype,
            spec.head_dim,
            spec.block_size,
            decode_kernel=spec.decode_kernel,
            prefill_kernel=spec.prefill_kernel,
            kv_dtype=spec.kv_cache_dtype,
        )
        self.handle = self.kernels.handle
        self.kv_scales: KVScales | None = None

    def use_kv_scales(self, kv_scales: KVScales | None) -> None:
        """An fp8 cache's scales (None: an fp8 cache is read and written with scale 1)."""
        self.kv_scales = kv_scales

    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (the model hands views of its qkv output)
        scales = None if self.kv_scales is None else self.kv_scales.before_write(k, v, layer, meta.slot_mapping)
        torch.ops.kiln.write_kv_cutlass(k, v, kv_cache, layer, meta.slot_mapping, self.handle, scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if sliding_window > 0 or softcap > 0:
            # kiln's kernels attend the whole context, uncapped: the reference op masks and caps,
            # in eager mode only (the constructor refuses such models when graphs are on). A spec
            # that did not declare them must not reach a captured graph: refuse here too.
            if self.spec.compile and not self.spec.windowed_or_capped:
                raise ValueError(
                    "attention_backend=cutlass: a sliding-window or soft-capped layer, but the "
                    "BackendSpec did not declare windowed_or_capped; use attention_backend=torch"
                )
            torch.ops.kiln.paged_attention(
                out,
                q,
                kv_cache,
                layer,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                meta.max_query_len,
                meta.max_seq_len,
                meta.num_decodes,
                sliding_window,
                softcap,
                scales,
            )
            return out
        torch.ops.kiln.paged_attention_cutlass(
            out,
            q,
            kv_cache,
            layer,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            meta.num_decodes,
            self.handle,
            scales,
        )
        return out
