"""compiler/kernels/cpu_fused.py: each fused CPU op against the eager ops of engine/layers/ it
replaces (the eager code is the definition), float32 and bfloat16; bad input gets an error."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from compiler.kernels.cpu_fused import FUSED
from engine.layers.layernorm import RMSNorm
from engine.layers.mlp import MLP
from engine.layers.rotary import FusedRope, apply_interleaved_rope, apply_rope, interleaved_rope_tables

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def fused_library(tmp_path_factory):
    # The session's kiln compile cache (conftest's KILN_CACHE_DIR): later engines load this build.
    FUSED.load(tmp_path_factory.getbasetemp() / "kiln-cache" / "compile")
    assert FUSED.ready


@contextlib.contextmanager
def eager():
    FUSED.ready = False
    try:
        yield
    finally:
        FUSED.ready = True


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # bfloat16: at most one rounding step apart, and almost everywhere equal
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_add_rms_norm(dtype, offset):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6, offset).to(dtype)
    norm.fused = True
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(37, 96, generator=g).to(dtype)
    delta = torch.randn(37, 2 * 96, generator=g).to(dtype)[:, :96]  # rows at a stride
    with torch.inference_mode():
        with eager():
            want = norm(x)
            want_res, want_sum = norm.add_forward(x, delta)
        _close(norm(x), want, dtype)
        residual = x.clone()
        got_res, got_sum = norm.add_forward(residual, delta)
        assert got_res is residual and torch.equal(residual, want_res)  # added in place, same rounding
        _close(got_sum, want_sum, dtype)
        heads = torch.randn(5, 3, 2 * 96, generator=g).to(dtype)[..., :96]  # q/k-norm over [T, H, D] views
        with eager():
            want = norm(heads)
        _close(norm(heads), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_silu_and_mul(dtype, act):
    config = SimpleNamespace(hidden_size=16, intermediate_size=48, mlp_bias=False, hidden_act=act)
    mlp = MLP(config).to(dtype)
    mlp.fused = True
    mlp.down_proj = _Passthrough()  # the MLP's output is then the activation itself
    torch.manual_seed(1)
    with torch.inference_mode():
        x = torch.randn(23, 16).to(dtype)
        with eager():
            want = mlp(x)
        got = mlp(x)
        _close(got, want, dtype)
        gate, up = torch.randn(23, 96).to(dtype).chunk(2, dim=-1)
        ref = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
        _close(torch.ops.kiln_cpu_fused.silu_and_mul(torch.cat([gate, up], -1), act != "silu"), ref, dtype)


class _Passthrough(torch.nn.Module):
    def forward(self, h, lora=None):
        return h


def _tables(positions: int, rot: int, interleaved: bool) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    emb = interleaved_rope_tables(freqs) if interleaved else torch.cat([freqs, freqs], dim=-1)
    return torch.cat([emb.cos(), emb.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot,interleaved", [(32, False), (16, False), (16, True), (32, True)])
def test_rope_in_place_matches_eager(dtype, rot, interleaved):
    """q and k as the model has them (views of one qkv row); full, partial and interleaved rotary.
    Same roundings as the eager ops: equal bit for bit."""
    g = torch.Generator().manual_seed(rot)
    n, hq, hkv, d = 19, 4, 2, 32
    table = _tables(64, rot, interleaved)
    positions = torch.randint(0, 64, (n,), generator=g)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(n, hq, d), k.view(n, hkv, d)
    cos, sin = table[positions].to(dtype).chunk(2, dim=-1)
    rope = apply_interleaved_rope if interleaved else apply_rope
    want_q, want_k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
    v_before = qkv[:, (hq + hkv) * d :].clone()
    torch.ops.kiln_cpu_fused.rope_(q, k, positions, table, interleaved)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
    assert FusedRope(positions, table, interleaved).interleaved == interleaved


def test_modules_stay_eager_unless_switched_on():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert torch.equal(norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))


def test_bad_input_is_refused():
    ops = torch.ops.kiln_cpu_fused
    table = _tables(8, 16, False)
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rope_(q, k, torch.tensor([0, 8]), table, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(5), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="2 \\* I"):
        ops.silu_and_mul(torch.randn(2, 5), False)
