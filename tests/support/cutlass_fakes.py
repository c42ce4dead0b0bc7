"""The CUTLASS backend's kernels faked on the CPU, and their inputs."""

from __future__ import annotations

import torch

from compiler.kernels.cutlass_launch_args import DECODE_GROUPS
from compiler.kernels.cutlass_ops import AttentionKernels


class Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __call__(self, grid, stream, args):
        self.log.append((self.name, grid, args))


def fake_kernels(
    decode_kernel="v1",
    prefill_kernel="mma",
    head_dim=64,
    block_size=16,
    num_sms=132,
    occupancy=None,
    dtype=torch.bfloat16,
    monkeypatch=None,
):
    """An AttentionKernels whose launchers record instead of launching (CPU tensors, stream 0)."""
    k = AttentionKernels.__new__(AttentionKernels)
    k.device = torch.device("cpu")
    k.dtype, k.head_dim, k.block_size = dtype, head_dim, block_size
    k.decode_kernel, k.prefill_kernel = decode_kernel, prefill_kernel
    k.log = []
    k.write_kv_l = Recorder("write_kv", k.log)
    k.decode_l = {g: Recorder(f"decode_g{g}", k.log) for g in DECODE_GROUPS}
    k.combine_l = Recorder("combine", k.log) if decode_kernel == "v1" else None
    k.prefill_l = Recorder("prefill", k.log)
    k.block_m = 128 if prefill_kernel == "wgmma" else 64
    k._init_state(num_sms, occupancy or {1: 4, 2: 4, 4: 3, 8: 2}, 1 << 22)
    k._stream = lambda device: 0
    return k


def make_inputs(seqs, hq=8, hkv=2, d=64, bs=16, tail=0, table_pad=0, seed=0):
    """seqs: (q_len, seq_len) per sequence, decodes first. A one-layer cache [1, 2, blocks, ...]."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // bs) for _, s in seqs]
    width = max(nblk) + 1
    table = torch.zeros(len(seqs), width + table_pad, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(nblk):
        table[i, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
        nxt += n
    qsl = torch.tensor([0] + torch.tensor([q for q, _ in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    T = int(qsl[-1]) + tail
    kv = torch.randn(1, 2, nxt + 1, bs, hkv, d, generator=g).to(torch.bfloat16)
    return dict(
        q=torch.randn(T, hq, d, generator=g).to(torch.bfloat16),
        kv=kv,
        qsl=qsl,
        lens=torch.tensor([s for _, s in seqs], dtype=torch.int32),
        table=table[:, :width],
        max_q=max(q for q, _ in seqs),
        max_len=max(s for _, s in seqs),
    )
