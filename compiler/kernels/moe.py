"""The routed experts of a mixture-of-experts FFN, as one opaque op (`kiln::moe_experts`, registered
in compiler/kernels/ops.py).

Inputs: the tokens x [T, H], the router's choice per token (weights and expert ids, [T, k]),
and the stacked expert weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
Output: sum over the k chosen experts of weight * down(act(gate(x)) * up(x)), [T, H].

Nothing here reads a routing count on the host, so a captured CUDA graph replays it as is:
the T*k (token, expert) pairs are sorted by expert, each expert's rows run as one group of
`torch._grouped_mm` (a grouped GEMM; CUTLASS's on Hopper) and the weighted rows are added
back to their tokens. Where `_grouped_mm` does not take the inputs (it wants bf16 on a GPU),
every expert runs on every token as one batched matmul and the zero weights drop what an
expert was not chosen for: the same result for E/k times the arithmetic.

`moe_experts_pairs` is the form for experts whose weights are dequantised per call (quantised
experts, engine/layers/quant/moe.py): when a step has fewer (token, expert) pairs than experts (decode),
only the chosen experts' weights are dequantised, one copy per pair, and each pair's two
projections are one batched matrix-vector product: plain torch ops, no host sync, no Python loop.

`moe_experts_int4_cpu` (kiln::moe_experts_int4) runs int4 experts in torch's packed CPU layout
(engine/layers/quant/int4_packed.py) through `_weight_int4pack_mm_for_cpu`: the pairs are grouped by
expert on the host (the CPU has no graph to break) and each chosen expert's tokens are one
kernel call per projection, so a decode step touches only the experts it chose.

Why an opaque op: `_grouped_mm`'s meta function only accepts bf16, which would keep float32
models out of the compiled graph, and the op's shape ([T, H] from [T, H]) is all Dynamo needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _act(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if activation == "gelu_pytorch_tanh" else F.silu(gate)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs float32 and bf16 on the CPU, bf16 on a GPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return x.dtype in (torch.float32, torch.bfloat16) if x.device.type == "cpu" else x.dtype == torch.bfloat16


def moe_experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str
) -> torch.Tensor:
    num_experts, k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k  # the token of each sorted (token, expert) pair
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # end row of each expert's group
    gate_up = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    rows = torch._grouped_mm(_act(gate, activation) * up, w2.transpose(1, 2), offs=offsets)
    rows = rows.float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, rows).to(x.dtype)


def moe_experts_dense(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str
) -> torch.Tensor:
    num_experts = w13.shape[0]
    combine = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, ids, weights.float())  # [T, E]: 0 where the expert was not chosen
    gate_up = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    rows = torch.matmul(_act(gate, activation) * up, w2.transpose(1, 2))  # [E, T, H]
    return torch.einsum("eth,te->th", rows.float(), combine).to(x.dtype)


def moe_experts_forward(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str
) -> torch.Tensor:
    """The body of kiln::moe_experts (registered in compiler/kernels/ops.py)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if grouped_mm_supported(x):
        return moe_experts_grouped(x, weights, ids, w13, w2, activation)
    return moe_experts_dense(x, weights, ids, w13, w2, activation)


def moe_experts_pairs(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str
) -> torch.Tensor:
    """The same sum with one weight per (token, choice) pair, in ids.reshape(-1)'s order:
    w13 [T*k, 2I, H], w2 [T*k, H, I] (pair p is token p // k's choice p % k)."""
    num_tokens, k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    xs = x.repeat_interleave(k, dim=0)  # [T*k, H]: each pair's token
    gate_up = torch.bmm(w13, xs.unsqueeze(-1)).squeeze(-1)  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    rows = torch.bmm(w2, (_act(gate, activation) * up).unsqueeze(-1)).squeeze(-1)  # [T*k, H]
    rows = rows.float() * weights.reshape(-1, 1).float()
    return rows.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


def moe_experts_int4_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_sz: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_sz: torch.Tensor,
    w13_perm: torch.Tensor | None,
    w2_perm: torch.Tensor | None,
    group13: int,
    group2: int,
    activation: str,
) -> torch.Tensor:
    """The routed experts' sum with int4 experts packed per expert: w13_packed/w2_packed [E, ...]
    (from _convert_weight_to_int4pack_for_cpu), scales-and-zeros [E, K / group, N, 2] in the
    kernel's activation dtype, act-order column permutations [E, K] or None."""
    num_tokens, k = ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    pairs: dict[int, list[int]] = {}
    for p, e in enumerate(ids.reshape(-1).tolist()):
        pairs.setdefault(e, []).append(p)
    flat_weights = weights.reshape(-1).float()
    for e, chosen in pairs.items():  # only the experts some token chose
        index = torch.tensor(chosen, device=x.device)
        tokens = index // k
        xe = x.index_select(0, tokens).to(w13_sz.dtype)
        if w13_perm is not None:
            xe = xe.index_select(1, w13_perm[e])
        gate, up = kernel(xe.contiguous(), w13_packed[e], group13, w13_sz[e]).chunk(2, dim=-1)
        h = _act(gate, activation) * up
        if w2_perm is not None:
            h = h.index_select(1, w2_perm[e])
        rows = kernel(h.contiguous(), w2_packed[e], group2, w2_sz[e]).float() * flat_weights[index, None]
        out.index_add_(0, tokens, rows)
    return out.to(x.dtype)
