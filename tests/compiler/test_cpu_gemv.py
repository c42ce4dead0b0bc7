"""compiler/kernels/cpu_gemv.py: every weight-streaming kernel against dequantise-then-matmul, on every
instruction-set level this CPU runs (the generic C++ one always, AVX2 / AVX-VNNI / AVX-512 /
AVX-512-VNNI where present), both activation paths, float32 and bfloat16 activations.

Tolerances (also in docs/models.md), per output y = sum_k w_k x_k against the float64 product of
the file's dequantised weights, with S = sum_k |w_k x_k|:
  float path, dense:  |dy| <= 1e-5 S   (float32 sums in another order), + half a bf16 step of y
                      when the output is bfloat16
  int path:           |dy| <= sum_k |w_k| amax_b(k) / 254 + 1e-5 S: each activation is rounded
                      to its block's step amax_b / 127, so off by at most half of it
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compiler.kernels import cpu_extension, cpu_gemv, cpu_linear
from compiler.kernels.cpu_gemv import GEMV, GGUF_FORMATS, INT4, INT8, LEVELS
from engine.layers.quant import cpu_packed, gguf_blocks
from tests.support.gguf_writer import random_k_blocks
from tests.support.prebuilt_kernels import prebuilt_dir

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module", autouse=True)
def library():
    assert GEMV.ensure(), GEMV.error  # (never skipped: a CPU without the kernels is a failure here)
    print(f"levels run here: {[LEVELS[v] for v in GEMV.levels]}, default {LEVELS[GEMV.level]}")


def _gguf_raw(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if name.endswith("_K"):
        return torch.from_numpy(random_k_blocks(name, n, k, rng)).contiguous()
    w = rng.normal(0, 0.05, size=(n, k)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])).reshape(n, -1).contiguous()


def _int_weights(bits: int, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    s = torch.rand(n, groups, generator=g) * 0.01 + 0.001
    z = torch.randint(0, 2**bits, (n, groups), dtype=torch.uint8, generator=g)
    w = (q.double() - z.double().repeat_interleave(group, 1)) * s.double().repeat_interleave(group, 1)
    return q, s, z, w


def _bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, int_acts: bool) -> torch.Tensor:
    """The tolerance of each output (module docstring)."""
    xd = x.double()
    bound = 1e-5 * (xd.abs() @ w.abs().T)
    if int_acts:
        amax = xd.reshape(x.shape[0], -1, 32).abs().amax(-1).repeat_interleave(32, 1)
        bound += (amax / 254) @ w.abs().T
    if y.dtype == torch.bfloat16:
        bound += y.double().abs() * 2.0**-8
    return bound + 1e-30


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, int_acts: bool, what, bias=None) -> None:
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    err = (y.double() - ref).abs()
    over = err / _bound(x, w, y, int_acts)
    assert over.max() <= 1, f"{what}: error {err.max():.3e} is {over.max():.2f}x its bound"


ROWS = [1, 6]  # (6: a tile of 4 and one of 2 on AVX-512, three of 2 on AVX2)


def _cases():
    """(rows, activation dtype, level): every level at a few rows, the best one at more."""
    for level in GEMV.levels:
        for rows in ROWS + ([3, 21] if level == GEMV.level else []):
            for dtype in (torch.float32, torch.bfloat16) if level in (0, GEMV.level) else (torch.float32,):
                yield rows, dtype, level


@pytest.mark.parametrize("name", list(GGUF_FORMATS))
def test_gguf_formats_every_level_and_path(name):
    n, k = 40, 256  # (40: two groups of 16 rows and a padded one)
    raw = _gguf_raw(name, n, k)
    fmt = GGUF_FORMATS[name]
    w = gguf_blocks.dequantize(raw, fmt, (n, k)).double()
    packed = cpu_gemv.pack(raw, fmt, k)
    # the packed layout holds the same weights: fma(q, d, m) against ggml's two roundings (every level)
    for level in GEMV.levels:
        got = cpu_gemv.dequantize(packed, fmt, n, k, level=level).double()
        torch.testing.assert_close(got, w, rtol=0, atol=1e-6 * w.abs().max())
    bf16 = cpu_gemv.dequantize(packed, fmt, n, k, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, got.float().bfloat16())  # (rounded to nearest even)
    # whole row groups of it (packed[g0:g1]) into a given tensor: the same rows, bit for bit
    out = torch.full((n - 16, k), float("nan"))
    assert cpu_gemv.dequantize(packed[1:], fmt, n - 16, k, out=out) is out
    assert torch.equal(out, cpu_gemv.dequantize(packed, fmt, n, k)[16:])
    with pytest.raises(RuntimeError, match="dequantize into"):
        cpu_gemv.dequantize(packed[1:], fmt, n - 16, k, out=torch.empty(n - 16, k + 32))
    g = torch.Generator().manual_seed(1)
    for rows, dtype, level in _cases():
        x = torch.randn(rows, k, generator=g).to(dtype)
        for int_acts in (True, False):
            y = cpu_gemv.quant(x, packed, fmt, n, k, int_acts=int_acts, level=level)
            assert y.dtype == dtype and y.shape == (rows, n)
            _check(y, x, w, int_acts, (name, rows, dtype, LEVELS[level], int_acts))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, 256])
def test_kiln_int_formats_every_level_and_path(bits, group):
    n, k = 24, 256
    q, s, z, w = _int_weights(bits, n, k, group)
    fmt = INT4 if bits == 4 else INT8
    packed = cpu_gemv.pack(q, fmt, k, s, z)
    for level in GEMV.levels:
        torch.testing.assert_close(
            cpu_gemv.dequantize(packed, fmt, n, k, k // group, level=level).double(),
            w,
            rtol=0,
            atol=1e-6 * w.abs().max(),
        )
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=g)
    for rows, dtype, level in _cases():
        x = torch.randn(rows, k, generator=g).to(dtype)
        for int_acts in (True, False):
            y = cpu_gemv.quant(x, packed, fmt, n, k, k // group, bias=bias, int_acts=int_acts, level=level)
            _check(y, x, w, int_acts, (bits, group, rows, LEVELS[level], int_acts), bias)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_every_level(wdtype):
    g = torch.Generator().manual_seed(3)
    for k in (576, 70):  # (70: a tail shorter than a vector)
        w = torch.randn(36, k, generator=g).to(wdtype)
        bias = torch.randn(36, generator=g)
        for rows, dtype, level in _cases():
            if wdtype != dtype and dtype == torch.bfloat16:
                continue
            x = torch.randn(rows, k + 9, generator=g).to(dtype)[:, :k]  # (rows at a stride)
            y = cpu_gemv.dense(x, w, bias, level=level)
            _check(y, x, w.double(), False, (wdtype, k, rows, dtype, LEVELS[level]), bias)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_one_row_equals_its_row_of_a_batch(wdtype):
    """A single activation row runs the row-by-row path (one stream per thread), several rows the
    tiles; a row's bits are the same either way, on every level (a batch-1 decode and a verify or
    batched step of the same sequence agree), with tails of rows and of K."""
    g = torch.Generator().manual_seed(5)
    for n, k in ((200, 576), (37, 70)):
        w = torch.randn(n, k, generator=g).to(wdtype)
        bias = torch.randn(n, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            if wdtype != dtype and dtype == torch.bfloat16:
                continue
            x = torch.randn(4, k, generator=g).to(dtype)
            for level in GEMV.levels:  # (the levels this CPU runs: Zen 4 has AVX-512 VNNI but no AVX-VNNI)
                batch = cpu_gemv.dense(x, w, bias, level=level)
                for i in range(4):
                    one = cpu_gemv.dense(x[i : i + 1], w, bias, level=level)
                    assert torch.equal(one[0], batch[i]), (wdtype, n, k, dtype, LEVELS[level], i)


def test_runs_into_a_slice_of_the_output_and_threads_agree():
    """A fused layer's runs write their columns of one output; 1 and 2 threads give the same bits."""
    n, k = 48, 256
    raw_a, raw_b = _gguf_raw("Q4_K", n, k), _gguf_raw("Q6_K", 16, k, seed=1)
    x = torch.randn(5, k)
    out = torch.full((5, n + 16), float("nan"))
    pa, pb = cpu_gemv.pack(raw_a, GGUF_FORMATS["Q4_K"], k), cpu_gemv.pack(raw_b, GGUF_FORMATS["Q6_K"], k)
    cpu_gemv.quant(x, pa, GGUF_FORMATS["Q4_K"], n, k, out=out[:, :n])
    cpu_gemv.quant(x, pb, GGUF_FORMATS["Q6_K"], 16, k, out=out[:, n:])
    assert not out.isnan().any()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.quant(x, pa, GGUF_FORMATS["Q4_K"], n, k)
        torch.set_num_threads(2)
        two = cpu_gemv.quant(x, pa, GGUF_FORMATS["Q4_K"], n, k)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one, out[:, :n])


# sha256 (first 16 hex digits) of pack's output for random bytes of every format, 40 rows (a padded
# row group) of K = 512, as main at 644d2e9 packed them: a faster pack must write the same bytes
PACKED_DIGESTS = {
    "Q4_0": "b25f9094e3b6d97f",
    "Q4_1": "ec0ca780d42cef07",
    "Q5_0": "953a6d0bd7124fba",
    "Q5_1": "ed079f6c5d62943f",
    "Q8_0": "3a9bbac9af5ce9b2",
    "Q4_K": "f58dcd77bef0af07",
    "Q5_K": "9732278abd3ae630",
    "Q6_K": "c34497b5cdfaa2f8",
    "int4": "90184d872976a490",
    "int8": "252a43af9b0e6561",
}
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _random_pack_input(name: str, n: int = 40, k: int = 512):
    """(data, format, scales, zeros) of random bytes for `pack` (any bytes are a valid block: pack copies bits)."""
    if name in GGUF_FORMATS:
        fmt = GGUF_FORMATS[name]
        values = 256 if name.endswith("_K") else 32
        rng = np.random.default_rng(fmt)
        data = rng.integers(0, 256, size=(n, k // values * GGUF_BLOCK_BYTES[name]), dtype=np.uint8)
        return torch.from_numpy(data), fmt, None, None
    bits, fmt = (4, INT4) if name == "int4" else (8, INT8)
    rng = np.random.default_rng(fmt)
    q = rng.integers(0, 2**bits, size=(n, k), dtype=np.uint8)
    s = rng.random((n, 4), dtype=np.float32)
    z = rng.integers(0, 2**bits, size=(n, 4), dtype=np.uint8)
    return torch.from_numpy(q), fmt, torch.from_numpy(s), torch.from_numpy(z)


@pytest.mark.parametrize("name", [*GGUF_FORMATS, "int4", "int8"])
def test_pack_writes_the_same_bytes_as_before(name):
    data, fmt, scales, zeros = _random_pack_input(name)
    packed = cpu_gemv.pack(data, fmt, 512, scales, zeros)
    assert hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:16] == PACKED_DIGESTS[name]
    # into a given buffer (every byte written, whatever was there) and of its packed_shape
    out = torch.full(cpu_gemv.packed_shape(fmt, 40, 512, 0 if scales is None else 4), 0xAB, dtype=torch.uint8)
    assert cpu_gemv.pack(data, fmt, 512, scales, zeros, out=out) is out and torch.equal(out, packed)
    with pytest.raises(RuntimeError, match="pack into"):
        cpu_gemv.pack(data, fmt, 512, scales, zeros, out=out[1:])


def test_fused_parts_pack_into_their_row_groups():
    """gguf_runs packs each part of a run into its row groups of one buffer (no concatenated copy)
    where the parts before it are whole row groups: the same bytes as packing them concatenated;
    each buffer is shown to on_allocated before it is written."""
    k = 256
    q, kk, v = (_gguf_raw("Q8_0", n, k, seed) for n, seed in ((32, 0), (16, 1), (20, 2)))
    odd = _gguf_raw("Q8_0", 20, k, 3)
    seen: list[torch.Tensor] = []

    def on_allocated(tensors):
        for t in tensors:
            t.fill_(0xAB)  # (what pack finds there must not matter)
        seen.extend(tensors)

    fmt = GGUF_FORMATS["Q8_0"]
    for parts in ([q, kk, v], [odd, q]):  # (whole row groups first; a padded group first: concatenated)
        starts = [sum(p.shape[0] for p in parts[:i]) for i in range(len(parts))]
        runs, packed = cpu_packed.gguf_runs([(at, "Q8_0", p) for at, p in zip(starts, parts)], k, on_allocated)
        assert runs == [(0, sum(p.shape[0] for p in parts), fmt, 0)] and packed[0] is seen[-1]
        assert torch.equal(packed[0], cpu_gemv.pack(torch.cat(parts), fmt, k))


def test_a_broken_weight_fails_the_check():
    """The check above can fail: the float path's bound catches one wrong nibble (two weights of
    one row), the int path's looser one a wrong scale (one row's block)."""
    n, k = 32, 256
    raw = _gguf_raw("Q4_1", n, k)
    fmt = GGUF_FORMATS["Q4_1"]
    w = gguf_blocks.dequantize(raw, fmt, (n, k)).double()
    # (seeded: with the session's random state the broken nibble could land where x is near 0)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    for int_acts, at, flip in ((False, 64 + 36, 0x77), (True, 2 * 9 + 1, 0x04)):  # (a nibble byte; row 9's d)
        packed = cpu_gemv.pack(raw, fmt, k)
        _check(cpu_gemv.quant(x, packed, fmt, n, k, int_acts=int_acts), x, w, int_acts, "intact")
        packed[0, at] ^= flip
        with pytest.raises(AssertionError, match="its bound"):
            _check(cpu_gemv.quant(x, packed, fmt, n, k, int_acts=int_acts), x, w, int_acts, "broken")


def test_bad_input_is_a_clear_error():
    raw = _gguf_raw("Q8_0", 16, 64)
    fmt = GGUF_FORMATS["Q8_0"]
    packed = cpu_gemv.pack(raw, fmt, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_gemv.quant(torch.randn(2, 32), packed, fmt, 16, 64)
    with pytest.raises(RuntimeError, match="wrong shape"):
        cpu_gemv.quant(torch.randn(2, 64), packed, fmt, 32, 64)
    with pytest.raises(RuntimeError, match="whole number of blocks"):
        cpu_gemv.pack(raw[:, :17].contiguous(), fmt, 16)
    with pytest.raises(RuntimeError, match="GGUF rows of"):
        cpu_gemv.pack(raw[:, :34].contiguous(), fmt, 64)
    with pytest.raises(RuntimeError, match="cannot run|does not exist"):
        cpu_gemv.quant(torch.randn(1, 64), packed, fmt, 16, 64, level=7)
    with pytest.raises(RuntimeError, match="int4 values above 15"):
        cpu_gemv.pack(
            torch.full((16, 64), 16, dtype=torch.uint8),
            INT4,
            64,
            torch.ones(16, 1),
            torch.zeros(16, 1, dtype=torch.uint8),
        )


@pytest.mark.parametrize("gemm_rows", [None, 20, 1 << 40], ids=["default", "measured-20", "never"])
@pytest.mark.parametrize("float_acts", [True, False])
def test_packed_layer_every_row_count(float_acts, gemm_rows):
    """engine/layers/quant/cpu_packed.py: a fused layer of two formats (Q4_K_M's q/k and v) with a
    bias, through the kernels below its gemm_rows rows (the default GEMM_ROWS, or a machine's
    measured crossover: engine/runtime/builder_cpu_crossover.py) and the GEMM on its dequantised
    weight from there, leading dimensions kept; its weight() is the file's."""
    from engine.layers.linear import Linear
    from engine.layers.quant import cpu_packed

    k, parts = 256, [("Q4_K", 48), ("Q6_K", 16)]
    raws = [_gguf_raw(name, n, k, seed=i) for i, (name, n) in enumerate(parts)]
    w = torch.cat([gguf_blocks.dequantize(r, GGUF_FORMATS[name], (n, k)) for r, (name, n) in zip(raws, parts)])
    layer = Linear(k, 64, bias=True)
    layer.bias.data.normal_()
    runs, packed = cpu_packed.gguf_runs([(0, "Q4_K", raws[0]), (48, "Q6_K", raws[1])], k)
    cpu_packed.install(layer, runs, packed, None, float_acts)
    assert layer.weight is None and [r[2] for r in layer.gemv_runs] == [GGUF_FORMATS["Q4_K"], GGUF_FORMATS["Q6_K"]]
    torch.testing.assert_close(layer.quant.weight(layer, torch.float32), w, rtol=0, atol=1e-6 * w.abs().max())
    assert layer.quant.gemm_rows == cpu_packed.default_gemm_rows(float_acts)
    if gemm_rows is not None:
        layer.quant.gemm_rows = gemm_rows
    gemm_from = layer.quant.gemm_rows
    default = cpu_packed.GEMM_ROWS[float_acts]
    with torch.inference_mode():
        for rows in sorted({1, 5, *(r for r in (gemm_from - 1, gemm_from) if r < 1 << 20), default, 2 * default + 3}):
            x = torch.randn(1, rows, k)
            y = layer(x)
            assert y.shape == (1, rows, 64)
            int_path = not float_acts and rows < gemm_from
            _check(y[0], x[0], w.double(), int_path, (rows, float_acts), layer.bias)


def test_dense_dispatch_in_cpu_linear():
    """compiler/kernels/cpu_linear.py linear: up to MAX_DENSE_ROWS rows through the kernel (as F.linear to
    float32 rounding), not under autograd; oneDNN / F.linear above."""
    w, b = torch.randn(40, 96), torch.randn(40)
    top = cpu_gemv.MAX_DENSE_ROWS[torch.float32]
    for rows in (1, top, top + 1, 40):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            assert cpu_gemv.dense_usable(x, w, b)
            torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 96, requires_grad=True)
    assert not cpu_gemv.dense_usable(x, w, b)
    cpu_linear.linear(x, w, b).sum().backward()
    assert x.grad is not None


@pytest.fixture
def nothing_prebuilt(tmp_path):
    """No library in the package's prebuilt folder (a checkout's holds `make venv`'s): the runtime build."""
    with prebuilt_dir(tmp_path / "prebuilt") as folder:
        yield folder


def test_a_library_that_cannot_build_is_logged_and_skipped(monkeypatch, tmp_path, caplog, nothing_prebuilt):
    """No compiler (and no library built at install): ensure() says so once (with the path taken
    instead) and the callers keep their torch paths; it is not retried."""
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no C++ compiler")

    lib = cpu_gemv.GemvLibrary()
    lib.configure(tmp_path / "cache")
    monkeypatch.setattr(cpu_extension, "build", broken)
    monkeypatch.setattr(cpu_gemv, "loaded", lambda: False)
    with caplog.at_level(logging.WARNING, logger="compiler.kernels.cpu_gemv"):
        assert not lib.ensure() and not lib.ensure()
    assert len(calls) == 1 and lib.state == "failed" and "no C++ compiler" in lib.error
    assert "dequantise on the fly" in caplog.text
    monkeypatch.setattr(cpu_gemv, "GEMV", lib)
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with torch.inference_mode():
        assert not cpu_gemv.dense_usable(x, w, None)
        torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))


def test_a_build_lock_left_by_a_dead_build_is_cleared(tmp_path):
    """A start killed mid-compile leaves ninja's lock behind; torch's builder would wait on it
    forever. The shared builder removes one older than STALE_LOCK_SECONDS, and keeps a fresh one
    (another process building right now)."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not cpu_extension.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - cpu_extension.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert cpu_extension.clear_stale_lock(tmp_path) and not lock.exists()
    assert not cpu_extension.clear_stale_lock(tmp_path)
