"""kiln's int4-weight x bf16-activation GEMM for decode shapes (templates/w4a16_gemm.cu.j2),
its load-time weight layout and its launcher (CUDA only, launched as compiler/kernels/cutlass_ops.py
launches the attention kernels: cubin from the kernel cache, cuda-python on torch's current stream).

    packed, scales, zeros = pack_w4a16(qweight, zeros, scales, group_size)   # at load, any device
    gemm = W4A16Gemm(cache_dir, device)
    y = torch.ops.kiln.w4a16_gemm(x, packed, scales, zeros, gemm.handle)   # (compiler/kernels/ops.py)
"""

from __future__ import annotations

import itertools
import weakref
from pathlib import Path

import torch

from compiler.kernels.loader import I32, I64, PTR, KernelLibrary, Launcher

_handles = itertools.count(1)

W4A16_VARIANT = "w4a16_gemm_bf16"
W4A16_THREADS = 256  # the template's WARPS * 32
W4A16_TOKEN_TILES = (1, 2, 4)  # entry points _t1/_t2/_t4: 8, 16, 32 tokens per CTA
_W4A16_TYPES = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64)
# Column of a word's nibble position p (0..7) among the word's 8 columns: nibble p = column 2p,
# nibble p + 4 = column 2p + 1 (so that one shift and mask gives a bf16x2 pair of adjacent columns).
W4A16_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_w4a16(
    qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kiln's int4 layer (qweight uint8 [N, K / 2], column 2j in the low nibble of byte j; zeros
    uint8 and scales float32 [N, K / group]) -> the w4a16_gemm kernel's buffers:

      packed uint8 [N / 16, K / 64, 32, 16]: tile (nt, ch) = rows 16 nt.., columns 64 ch..; lane
             l = 4 g + t holds 4 little-endian words: rows 16 nt + g (words 0, 1) and 16 nt + g + 8
             (words 2, 3), columns 64 ch + 16 t + 8 (word % 2) + W4A16_NIBBLE_COLUMN[p] in nibble p
      scales float32 [K / group, N] and zeros uint8 [K / group, N] (group-major: a warp's 16 rows
             of one group are contiguous)

    W[n, k] = (q - zeros[g, n]) * scales[g, n], g = k // group_size."""
    n, kb = qweight.shape
    k = 2 * kb
    reason = w4a16_unsupported(n, k, group_size)
    if reason is not None:
        raise ValueError(f"w4a16: {reason}")
    if tuple(zeros.shape) != (n, k // group_size) or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(
            f"w4a16: zeros {tuple(zeros.shape)} / scales {tuple(scales.shape)} for {n} rows and "
            f"{k // group_size} groups"
        )
    if int(zeros.max()) >= 128:
        raise ValueError("w4a16: zero points must be below 128 (the kernel adds them to bf16 128)")
    q = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(n, k)
    # (nt, half, g, ch, t, word, column) -> (nt, ch, g, t, half, word, nibble position)
    q = q.view(n // 16, 2, 8, k // 64, 4, 2, 8).permute(0, 3, 2, 4, 1, 5, 6)
    q = q[..., list(W4A16_NIBBLE_COLUMN)]
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(n // 16, k // 64, 32, 16).contiguous()
    return packed, scales.float().t().contiguous(), zeros.to(torch.uint8).t().contiguous()


def unpack_w4a16(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's buffers -> the dense float32 weight [N, K] (the inverse of pack_w4a16)."""
    nt, chunks = packed.shape[:2]
    n, k = 16 * nt, 64 * chunks
    nib = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(nt, chunks, 8, 4, 2, 2, 8)
    cols = torch.empty_like(nib)
    cols[..., list(W4A16_NIBBLE_COLUMN)] = nib
    q = cols.permute(0, 4, 2, 1, 3, 5, 6).reshape(n, k).float()
    group = k // scales.shape[0]
    g = torch.arange(k, device=packed.device) // group
    return (q - zeros.t().float()[:, g]) * scales.t()[:, g]


def w4a16_unsupported(n: int, k: int, group_size: int) -> str | None:
    """Why a layer's shape cannot take the kernel (None: it can)."""
    if n % 16:
        return f"{n} output rows (the kernel takes a multiple of 16)"
    if group_size <= 0 or group_size % 64 or k % group_size:
        return f"group size {group_size} with {k} input columns (the kernel takes a multiple of 64 dividing them)"
    return None


_live_gemms: "weakref.WeakValueDictionary[int, W4A16Gemm]" = weakref.WeakValueDictionary()


def w4a16_by_handle(handle: int) -> "W4A16Gemm":
    """The W4A16Gemm an op's `handle` names; raises if its owner has let it go."""
    g = _live_gemms.get(int(handle))
    if g is None:
        raise RuntimeError(f"kiln w4a16 GEMM #{handle} is not loaded (its owner was released)")
    return g


class W4A16Gemm:
    """The loaded w4a16_gemm kernel: y = x @ W^T with W from pack_w4a16's buffers.

        gemm = W4A16Gemm(cache_dir, device)
        packed, scales, zeros = pack_w4a16(qweight, zeros, scales, group_size)   # at load
        y = gemm(x, packed, scales, zeros)   # x bf16 [M, K]; or torch.ops.kiln.w4a16_gemm(..., gemm.handle)

    Launches on torch's current stream, read at each call; no host sync, no workspace (split-K
    is inside a CTA), so it is capturable in a CUDA graph (the output comes from torch's allocator,
    or `out`)."""

    def __init__(self, cache_dir, device) -> None:
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.lib = KernelLibrary(Path(cache_dir), [W4A16_VARIANT]).load(self.device)
        self.launch = {
            mt: Launcher(
                self.lib.function(W4A16_VARIANT, f"t{mt}"),
                W4A16_THREADS,
                0,
                _W4A16_TYPES,
                f"{W4A16_VARIANT}_t{mt}",
                self.lib.context,
            )
            for mt in W4A16_TOKEN_TILES
        }
        self.handle = next(_handles)
        _live_gemms[self.handle] = self

    @staticmethod
    def unsupported(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> str | None:
        """Why these tensors cannot go to the kernel (None: they can)."""
        m, k = x.shape
        groups, n = scales.shape
        if not (
            packed.dtype == torch.uint8
            and packed.is_contiguous()
            and packed.dim() == 4
            and tuple(packed.shape) == (n // 16, k // 64, 32, 16)
            and packed.data_ptr() % 16 == 0
        ):
            return f"packed weight {packed.dtype} {tuple(packed.shape)} for x {tuple(x.shape)} and {n} outputs"
        reason = w4a16_unsupported(n, k, k // groups if groups else 0)
        if reason is not None:
            return reason
        if not (
            scales.dtype == torch.float32
            and scales.is_contiguous()
            and zeros.dtype == torch.uint8
            and zeros.is_contiguous()
            and zeros.shape == scales.shape
        ):
            return f"scales {scales.dtype} / zeros {zeros.dtype} {tuple(zeros.shape)} (contiguous float32 / uint8)"
        if x.dtype != torch.bfloat16:
            return f"{x.dtype} activations (the kernel takes bfloat16)"
        return None

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        reason = self.unsupported(x, packed, scales, zeros)
        if reason is not None:
            raise ValueError(f"w4a16_gemm: {reason}")
        if not (x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0):
            x = x.clone(memory_format=torch.contiguous_format)  # (fresh storage: 16-byte aligned rows, K % 64 == 0)
        m, k = x.shape
        groups, n = scales.shape
        y = out if out is not None else torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        if out is not None and not (out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n) and out.stride(1) == 1):
            raise ValueError(f"w4a16_gemm: out {out.dtype} {tuple(out.shape)} (bfloat16 [M, N], unit column stride)")
        if m == 0:
            return y
        mt = next((t for t in W4A16_TOKEN_TILES if m <= 8 * t), W4A16_TOKEN_TILES[-1])
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self.launch[mt](
            (n // 16, 1, -(-m // (8 * mt))),
            stream,
            (
                x.data_ptr(),
                packed.data_ptr(),
                scales.data_ptr(),
                zeros.data_ptr(),
                y.data_ptr(),
                m,
                n,
                k,
                k // groups,
                x.stride(0),
                y.stride(0),
            ),
        )
        return y
