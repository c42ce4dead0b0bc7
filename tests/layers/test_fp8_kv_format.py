"""The fp8 (e4m3) KV cache's parts: the element format (rounding, subnormals, saturation, the
scaled write and read), the settings' names, the block sizing, and the scales the CUTLASS launches
pass (recorded, no GPU). (Engine runs on an fp8 cache: test_fp8_kv.py.)"""

from __future__ import annotations

import pytest
import torch

from compiler.kernels.kv_quant import FP8_DTYPE, FP8_MAX, calibrate_kv_scales, from_cache, quantize_fp8
from compiler.kernels.reference_attention import paged_attention_reference, write_kv_reference
from engine.config.settings import EngineSettings
from engine.layers.kv_cache import KVCache, resolve_kv_cache_dtype
from engine.worker import kv_sizing

# ---- the element format ----


def test_quantize_and_dequantize_by_hand():
    x = torch.tensor([1.0, 3.3, 500.0, -1000.0, 0.0004, -0.7, float("nan")])
    q = quantize_fp8(x, torch.tensor(2.0))
    assert q.dtype == FP8_DTYPE
    # x / 2 = 0.5, 1.65, 250, -500, 0.0002, -0.35 -> nearest e4m3: 0.5; 1.625 (grid 1/8 in [1, 2));
    # 256 (grid 16 in [128, 256]); -448 (saturated, not NaN); 0 (below half the smallest
    # subnormal 2^-9); -0.34375 (grid 1/64 in [0.25, 0.5)); NaN stays NaN.
    expected = torch.tensor([0.5, 1.625, 256.0, -FP8_MAX, 0.0, -0.34375, float("nan")])
    assert torch.equal(q.float()[:-1], expected[:-1]) and torch.isnan(q.float()[-1])
    back = from_cache(q, torch.float32, torch.tensor(2.0))
    assert torch.equal(back[:-1], 2 * expected[:-1])
    # Scale 1 (None): e4m3 as is; a bf16 read keeps every e4m3 value exactly.
    assert torch.equal(
        from_cache(quantize_fp8(x[:4], None), torch.bfloat16, None).float(), torch.tensor([1.0, 3.25, 448.0, -448.0])
    )


def test_quantize_is_round_to_nearest_even_with_subnormals_and_saturation():
    """Against every e4m3 value: x goes to the nearest one, exact ties to the even code (the
    one whose last mantissa bit is 0), subnormals (steps of 2^-9 below 2^-6) included, and
    anything past ±448 (inf too) saturates; what the CUDA write (__NV_SATFINITE) does."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    codes = torch.arange(256)
    finite = ~torch.isnan(grid) & ~((grid == 0) & (codes == 128))  # one zero, no NaN
    grid, codes = grid[finite], codes[finite]
    order = grid.argsort()
    grid, codes = grid[order], codes[order]
    assert grid[grid > 0].min() == 2**-9 and grid.max() == FP8_MAX
    ties = (grid[1:] + grid[:-1]) / 2  # exactly representable in float32
    x = torch.cat(
        [
            ties,
            torch.nextafter(ties, ties + 1),
            torch.nextafter(ties, ties - 1),
            torch.randn(20000) * torch.logspace(-4, 3, 20000),
            torch.tensor([449.0, 1e9, -float("inf")]),
        ]
    )
    hi = torch.searchsorted(grid, x.clamp(-FP8_MAX, FP8_MAX)).clamp(1, len(grid) - 1)
    lo = hi - 1
    xc = x.clamp(-FP8_MAX, FP8_MAX)
    d_lo, d_hi = xc - grid[lo], grid[hi] - xc
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    expected = torch.where(take_hi, grid[hi], grid[lo])
    assert torch.equal(quantize_fp8(x, None).float(), expected)


def test_dequantize_to_bf16_rounds_once():
    """The product element * scale is taken in float32 and rounded to bf16 once, as the kernels
    do in registers (a scale rounded to bf16 first would bias the whole layer)."""
    scale = torch.tensor(0.0123456)
    q = quantize_fp8(torch.randn(4096), scale)
    assert torch.equal(from_cache(q, torch.bfloat16, scale), (q.float() * scale).to(torch.bfloat16))


def test_write_kv_stores_scaled_bytes_and_attention_reads_them_back():
    k = torch.tensor([[[1.0, -3.0, 100.0, 0.5]]])  # [T=1, Hkv=1, D=4]
    v = torch.tensor([[[2.0, 7.0, -900.0, 0.25]]])
    kc = torch.zeros(3, 2, 1, 4, dtype=FP8_DTYPE)
    vc = torch.zeros_like(kc)
    write_kv_reference(k, v, kc, vc, torch.tensor([2]), torch.tensor(2.0), torch.tensor(0.5))
    assert torch.equal(kc[1, 0, 0].float(), torch.tensor([0.5, -1.5, 48.0, 0.25]))
    assert torch.equal(vc[1, 0, 0].float(), torch.tensor([4.0, 14.0, -448.0, 0.5]))  # -1800 saturates
    assert kc.float().count_nonzero() == 4  # nothing else written
    # One key: attention returns its value, dequantized (x * v_scale).
    out = paged_attention_reference(
        torch.ones(1, 1, 4),
        kc,
        vc,
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([[1]], dtype=torch.int32),
        0.5,
        1,
        1,
        k_scale=torch.tensor(2.0),
        v_scale=torch.tensor(0.5),
    )
    assert torch.equal(out[0, 0], torch.tensor([2.0, 7.0, -224.0, 0.25]))


def test_compiled_cpu_decode_reads_fp8_like_the_reference():
    from compiler.kernels.cpu_attention import paged_attention_cpu_impl

    torch.manual_seed(0)
    cache = torch.zeros(2, 2, 10, 16, 2, 32, dtype=FP8_DTYPE)
    scales = torch.tensor([[1.0, 1.0], [0.01, 0.02]])
    k, v = torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    write_kv_reference(k, v, cache[1, 0], cache[1, 1], torch.arange(16, 56), scales[1, 0], scales[1, 1])
    q = torch.randn(2, 4, 32)
    args = (
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([40, 20], dtype=torch.int32),
        torch.tensor([[1, 2, 3], [1, 2, 0]], dtype=torch.int32),
        0.2,
        1,
        40,
        2,
    )
    out = torch.empty_like(q)
    paged_attention_cpu_impl(out, q, cache, 1, *args, scales)
    ref = paged_attention_reference(q, cache[1, 0], cache[1, 1], *args, k_scale=scales[1, 0], v_scale=scales[1, 1])
    assert torch.allclose(out, ref, atol=1e-5)
    # ... and fp8 stays near the unquantized attention (e4m3 keeps ~2 significant digits).
    full = torch.zeros(10, 16, 2, 32), torch.zeros(10, 16, 2, 32)
    write_kv_reference(k, v, *full, torch.arange(16, 56))
    exact = paged_attention_reference(q, *full, *args)
    assert (out - exact).abs().max() < 0.1 * exact.abs().max()


def test_calibration_takes_the_first_real_rows_once():
    scales, done = torch.ones(2, 2), torch.zeros(2, dtype=torch.bool)
    k, v = torch.full((3, 1, 2), 4.48), torch.full((3, 1, 2), -8.96)
    k[2] = 1000.0  # a padding row (slot -1): ignored
    calibrate_kv_scales(k, v, torch.tensor([-1, -1, -1]), scales, done, 1)
    assert torch.equal(scales, torch.ones(2, 2)) and not done.any()  # padding only: nothing learnt
    calibrate_kv_scales(k, v, torch.tensor([5, 6, -1]), scales, done, 1)
    assert torch.allclose(scales[1], torch.tensor([0.01, 0.02])) and done.tolist() == [False, True]
    calibrate_kv_scales(k * 10, v, torch.tensor([5, 6, 7]), scales, done, 1)  # later rows: kept
    assert torch.allclose(scales[1], torch.tensor([0.01, 0.02])) and scales[0].tolist() == [1.0, 1.0]


# ---- settings and sizing ----


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_kv_cache_dtype_accepts_vllm_e4m3_names(name):
    assert resolve_kv_cache_dtype(EngineSettings(kv_cache_dtype=name).kv_cache_dtype, torch.bfloat16) == FP8_DTYPE
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_kv_cache_dtype_refuses_e5m2_and_unknown_names():
    with pytest.raises(ValueError, match="fp8_e5m2.*not supported.*e4m3"):
        EngineSettings(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="int8.*supported: auto, fp8, fp8_e4m3"):
        EngineSettings(kv_cache_dtype="int8")


def test_block_bytes_and_budget_follow_the_cache_dtype():
    shape = (4, 16, 2, 64)  # layers, block size, kv heads, head dim
    per = {d: KVCache.bytes_per_block(*shape, d) for d in (FP8_DTYPE, torch.bfloat16, torch.float32)}
    assert per[FP8_DTYPE] == 4 * 2 * 16 * 2 * 64
    budget = 1 << 30
    blocks = {d: kv_sizing.blocks_from_budget(budget, p, "cuda") for d, p in per.items()}
    assert blocks[FP8_DTYPE] == 2 * blocks[torch.bfloat16] == 4 * blocks[torch.float32]


def test_engine_block_count_doubles_vs_bf16(make_llm):
    bf16 = make_llm(dtype="bfloat16", kv_cache_memory_gb=0.01, max_model_len=64)
    fp8 = make_llm(dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_memory_gb=0.01, max_model_len=64)
    assert fp8.engine.core.kv_cache.tensor.dtype == FP8_DTYPE and fp8.engine.core.kv_cache.model_dtype == torch.bfloat16
    assert fp8.engine.core.kv_cache.num_blocks // 2 == bf16.engine.core.kv_cache.num_blocks  # twice, to whole blocks
    assert fp8.engine.core.pool.num_usable + 1 == fp8.engine.core.kv_cache.num_blocks
    t = fp8.engine.core.kv_cache.tensor
    assert t.numel() * t.element_size() <= 0.01 * (1 << 30)  # the budget holds


# ---- the CUTLASS launches (recorded, no GPU) ----


@pytest.mark.parametrize("decode_kernel", ["v1", "v2"])
def test_cutlass_fp8_launches_pass_the_layer_scales_last(decode_kernel):
    from tests.support.cutlass_fakes import fake_kernels, make_inputs

    k = fake_kernels(decode_kernel)
    k.kv_dtype, k.kv_fp8 = FP8_DTYPE, True
    c = make_inputs([(1, 300), (1, 20), (37, 100)])
    cache = c["kv"].float().to(FP8_DTYPE)
    scales = torch.tensor([[0.5, 0.25], [2.0, 3.0]])  # [layers, 2]: layer 1's pair is passed
    out = torch.zeros_like(c["q"])
    k.attention(
        out,
        c["q"],
        cache[0, 0],
        cache[0, 1],
        c["qsl"],
        c["lens"],
        c["table"],
        0.125,
        c["max_q"],
        c["max_len"],
        2,
        scales[1],
    )
    launches = [x for x in k.log if x[0] != "combine"]
    assert [name for name, _, _ in launches] == ["decode_g4", "prefill"]
    assert all(args[-1] == scales[1].data_ptr() for _, _, args in launches)
    k.log.clear()
    kv = torch.zeros(5, 2, 64, dtype=torch.bfloat16)
    k.write_kv(kv, kv, cache[0, 0], cache[0, 1], torch.arange(5))  # no scales: the unit pair
    assert k.log[0][2][-1] == k.unit_scales.data_ptr() and k.unit_scales.tolist() == [1.0, 1.0]
    # A bf16 cache on fp8 kernels is declined (the reference runs), not misread.
    assert "cache" in k.attention_unsupported(out, c["q"], c["kv"][0, 0], c["kv"][0, 1])
