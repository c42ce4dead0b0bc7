"""engine/runtime/builder_cpu_crossover.py: where quantised layers leave the CPU kernels for a GEMM,
measured per machine, cached, overridden by the setting, given to each layer; and the MLP's rows
in pieces on the kernels (cpu_packed.gated_rows_in_pieces)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from compiler.kernels import cpu_gemv
from engine.layers.quant import cpu_packed
from engine.runtime import builder_cpu_crossover as cc

Q4_K, Q6_K, Q8_0 = (cpu_gemv.GGUF_FORMATS[f] for f in ("Q4_K", "Q6_K", "Q8_0"))


@pytest.fixture(scope="module")
def kernels():
    if not cpu_gemv.GEMV.ensure():
        pytest.skip(f"CPU kernels unavailable: {cpu_gemv.GEMV.error}")


def test_rows_per_family_mode_and_defaults():
    """A layer takes the smallest row count of its runs' families (a fused Q4_K / Q6_K layer leaves
    the kernels as a whole); a family / mode not measured keeps the default of its path."""
    crossover = cc.Crossover({"k/f32-int8": 512, "q8/f32-int8": cc.NEVER, "k/bf16-int8": 96})
    assert crossover.gemm_rows([Q4_K, Q6_K], torch.float32, False) == 512
    assert crossover.gemm_rows([Q8_0], torch.float32, False) == cc.NEVER
    assert crossover.gemm_rows([Q8_0, Q4_K], torch.float32, False) == 512
    assert crossover.gemm_rows([Q4_K], torch.bfloat16, False) == 96
    assert crossover.gemm_rows([Q4_K], torch.float32, True) == cpu_packed.GEMM_ROWS[True]  # (not measured)
    assert crossover.gemm_rows([cpu_gemv.INT4], torch.float32, False) == cpu_packed.default_gemm_rows(False)
    assert cc.family_of(cpu_gemv.INT8) == "q8" and cc.family_of(cpu_gemv.GGUF_FORMATS["Q5_1"]) == "q4"
    with pytest.raises(ValueError, match="no kernel family"):
        cc.family_of(999)
    assert "at no step size" in crossover.summary(cc.NEVER) and "from 96 rows" in crossover.summary(96)


def test_the_measured_step_is_two_gemm_wins_in_a_row(kernels, monkeypatch):
    """The crossover is the first row count from which the GEMM wins twice in a row (a single noisy
    win does not move it), or at the last point measured; NEVER where the kernels won throughout.
    The sweep stops once decided. Timings are scripted: the kernels' cost per call is `rows`, the
    GEMM's given per row count."""

    def scripted(gemm):
        def time_point(layer, x, repeats, clock):
            rows = x.shape[0]
            return cc.Point(rows, float(rows), gemm.get(rows, 2.0 * rows))

        return time_point

    grid = (16, 32, 64, 128, 256)
    monkeypatch.setattr(cc, "SHAPE", (32, 256))
    cases = [
        ({32: 1.0, 128: 1.0, 256: 1.0}, 128, 5),  # (32 alone: noise)
        ({16: 1.0, 32: 1.0}, 16, 2),  # (stops after two wins)
        ({256: 1.0}, 256, 5),  # (the last point)
        ({}, cc.NEVER, 5),
        ({128: 0.96 * 128, 256: 0.96 * 256}, cc.NEVER, 5),  # (within the margin: no win)
    ]
    for gemm, want, points in cases:
        monkeypatch.setattr(cc, "time_point", scripted(gemm))
        rows, measured = cc.measure_one("k", "f32-int8", grid=grid)
        assert (rows, len(measured)) == (want, points), gemm


def test_a_real_sweep_times_both_paths(kernels, monkeypatch):
    """On the real kernels (a small layer, two row counts): both paths timed, positive."""
    monkeypatch.setattr(cc, "SHAPE", (32, 256))
    lines = []
    rows, points = cc.measure_one("q8", "f32-int8", grid=(16, 32), repeats=1, report=lines.append)
    assert [p.rows for p in points] == [16, 32] and all(p.kernels_s > 0 and p.gemm_s > 0 for p in points)
    assert rows in (16, 32, cc.NEVER) and len(lines) == 2 and "µs/row" in lines[0]


def test_cache_round_trip_setting_and_defaults(kernels, tmp_path):
    """Measured rows are cached per machine (CPU, kernels' level and build, torch) and read back at
    start-up; the setting overrides them; nothing cached: the defaults, saying how to measure."""
    assert cc.load(tmp_path) is None
    default = cc.resolve(None, tmp_path)
    assert default.rows == {} and "kiln build-kernels --cpu" in default.source
    path = cc.save(tmp_path, {"k/f32-int8": cc.NEVER, "q8/f32-int8": 768}, threads=2)
    assert path.parent == tmp_path / "cpu_crossover" and json.loads(path.read_text())["machine"]["cpu"]
    measured = cc.resolve(None, tmp_path)
    assert measured.rows == {"k/f32-int8": cc.NEVER, "q8/f32-int8": 768}
    assert "measured on this machine" in measured.source
    forced = cc.resolve(300, tmp_path)
    assert forced.gemm_rows([Q8_0], torch.float32, True) == 300 and "cpu_quant_gemm_rows=300" in forced.source
    other = dict(cc.machine(), cpu="another CPU")
    assert cc.cache_path(tmp_path, other) != path  # (another machine does not read this one's)
    path.write_text("{not json")
    assert cc.load(tmp_path) is None


def _mlp_layers(k: int, inter: int):
    """A gated MLP's packed layers: gate/up [2 inter, k] in Q4_K, down [k, inter] in Q6_K."""
    from tests.support.quant import packed_gguf_layer

    gate_up = packed_gguf_layer(("Q4_K",), (2 * inter,), k, bias=False)
    down = packed_gguf_layer(("Q6_K",), (k,), inter, bias=False)
    return gate_up, down


def test_apply_gives_each_packed_layer_its_rows(kernels):
    """apply: every packed layer gets the row count of its formats and activations; it returns the
    smallest (the step size up to which every layer stays on the kernels)."""
    gate_up, down = _mlp_layers(256, 256)
    model = torch.nn.ModuleDict({"gate_up": gate_up, "down": down, "dense": torch.nn.Linear(4, 4)})
    crossover = cc.Crossover({"k/f32-int8": 640, "k/bf16-int8": 320})
    assert cc.apply(model, crossover, torch.float32) == 640
    assert gate_up.quant.gemm_rows == down.quant.gemm_rows == 640
    assert cc.apply(model, crossover, torch.bfloat16) == 320
    assert cc.apply(model, cc.Crossover(), torch.float32) == cpu_packed.default_gemm_rows(False)


def test_default_rows_per_kernel_level(kernels):
    """Unmeasured, the int8 path leaves the kernels at GEMM_ROWS[False] rows on kernels without VNNI
    and never on VNNI kernels (they beat the GEMM at every row count measured); the float path at
    GEMM_ROWS[True] on any level."""
    before = cpu_gemv.GEMV.max_level
    try:
        for name in [n for n in cpu_gemv.LEVELS if cpu_gemv.LEVELS.index(n) in cpu_gemv.GEMV.levels]:
            cpu_gemv.GEMV.limit(name)
            vnni = cpu_gemv.LEVELS[cpu_gemv.GEMV.level].endswith("_vnni")
            assert cpu_packed.default_gemm_rows(False) == (cc.NEVER if vnni else cpu_packed.GEMM_ROWS[False]), name
            assert cpu_packed.default_gemm_rows(True) == cpu_packed.GEMM_ROWS[True]
    finally:
        cpu_gemv.GEMV.limit(cpu_gemv.LEVELS[before])


def test_gated_rows_in_pieces_are_the_whole_steps_bits(kernels, monkeypatch):
    """Above MLP_PIECE_ROWS rows on the kernels the MLP runs in pieces of rows: the same bits as in
    one go (the kernels compute each row alone), never the whole [rows, 2 I] product; it declines
    at piece rows or fewer. The MLP takes pieces only where both its layers stay on the kernels."""
    from engine.layers.mlp import MLP

    k, inter = 256, 256
    gate_up, down = _mlp_layers(k, inter)
    for layer in (gate_up, down):
        layer.quant.gemm_rows = cc.NEVER

    def act(gu):
        gate, up = gu.split(gu.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    x = torch.randn(cpu_packed.MLP_PIECE_ROWS + 44, k)
    with torch.inference_mode():
        whole = down(act(gate_up(x)))
        for piece in (40, 16):
            assert torch.equal(cpu_packed.gated_rows_in_pieces(gate_up, down, act, x, piece), whole)
        assert cpu_packed.gated_rows_in_pieces(gate_up, down, act, x[:40], 40) is None
    assert cpu_packed.on_kernels(gate_up, 10**6) and not cpu_packed.on_kernels(torch.nn.Linear(2, 2), 1)
    down.quant.gemm_rows = 64
    assert not cpu_packed.on_kernels(down, 64) and cpu_packed.on_kernels(down, 63)

    # (the MLP module: pieces only where both layers are on the kernels for the step)
    class Cfg:
        hidden_size, intermediate_size, mlp_bias, hidden_act = k, inter, False, "silu"

    with torch.device("meta"):
        mlp = MLP(Cfg())
    mlp.gate_up_proj, mlp.down_proj = gate_up, down
    calls = []
    real = cpu_packed.gated_rows_in_pieces
    monkeypatch.setattr(cpu_packed, "gated_rows_in_pieces", lambda *a, **kw: calls.append(len(a[3])) or real(*a, **kw))
    with torch.inference_mode():
        mlp(x)
        assert calls == []  # (down runs these rows as a GEMM: one go)
        down.quant.gemm_rows = cc.NEVER
        assert torch.equal(mlp(x), whole) and calls == [x.shape[0]]


def test_decoder_stack_steps_follow_the_crossover(kernels):
    """The C++ decoder stack takes steps of up to one row below a packed layer's crossover, at most
    MLP_PIECE_ROWS (its MLP product is whole: larger steps go to the eager forward in pieces); a
    dense layer's limit is the dense kernel's."""
    from engine.models import cpu_stack

    gate_up, _ = _mlp_layers(256, 256)
    for rows, want in ((64, 63), (cpu_packed.MLP_PIECE_ROWS, cpu_packed.MLP_PIECE_ROWS - 1), (cc.NEVER, 256)):
        gate_up.quant.gemm_rows = rows
        assert cpu_stack._kernel_rows(gate_up, torch.float32) == min(want, cpu_packed.MLP_PIECE_ROWS)
    dense = torch.nn.Linear(8, 8)
    dense.quant = None
    assert cpu_stack._kernel_rows(dense, torch.float32) == cpu_gemv.MAX_DENSE_ROWS[torch.float32]
