"""The cutlass backend's host side, on the CPU: op registration in fresh processes, backend
choice (capability, model features, kernel settings), the launches one call becomes (rows split
between the decode and prefill kernels, chunks, pointer offsets, strided block tables), and no
silent reference fallback inside graph capture. The kernels are stood in for by recorders; their
GPU correctness is tests/compiler/test_kernels_gpu.py's."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler.kernels import cutlass_ops
from compiler.kernels.reference_attention import paged_attention_reference
from engine.layers.attention import cutlass_backend
from engine.layers.attention.base import BackendSpec
from engine.layers.attention.selector import get_attention_backend
from tests.support.cutlass_fakes import fake_kernels, make_inputs

REPO = Path(__file__).resolve().parents[2]


# ---- 1. every op the engine calls exists, whatever the backend --------------------------------


def _ops_the_code_calls() -> set[str]:
    names = set()
    for root in ("engine", "compiler"):
        for path in (REPO / root).rglob("*.py"):
            names.update(re.findall(r"torch\.ops\.kiln\.(\w+)", path.read_text()))
    return names


_CHECK = """
import json, sys, torch
import engine.runtime.llm_engine  # what every engine process imports
{extra}
missing = [n for n in json.loads(sys.argv[1]) if not hasattr(torch.ops.kiln, n)]
print(json.dumps(missing))
"""


@pytest.mark.parametrize(
    "backend,extra",
    [
        ("torch", "from engine.layers.attention.torch_backend import TorchAttentionBackend; TorchAttentionBackend()"),
        # no GPU here: the cutlass backend's module must import and the ops must be registered anyway
        ("cutlass", "from engine.layers.attention.cutlass_backend import CutlassAttentionBackend"),
    ],
)
def test_every_op_the_engine_calls_is_registered_in_a_fresh_process(backend, extra):
    ops = _ops_the_code_calls()
    assert {
        "copy_blocks",
        "paged_attention",
        "write_kv",
        "paged_attention_cpu",
        "moe_experts",
        "write_kv_cutlass",
        "paged_attention_cutlass",
    } <= ops, ops  # the scan finds the calls
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK.format(extra=extra), json.dumps(sorted(ops))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], f"{backend}: ops not registered"


def test_ops_are_defined_in_one_module():
    defining = [
        p.relative_to(REPO).as_posix()
        for root in ("engine", "compiler")
        for p in (REPO / root).rglob("*.py")
        if "torch.library.custom_op(" in p.read_text()
    ]
    assert defining == ["compiler/kernels/ops.py"]


# ---- the launches one call becomes ---------------------------------------------------------------


def call(k, c, num_decodes):
    out = torch.zeros_like(c["q"])
    k.attention(
        out,
        c["q"],
        c["kv"][0, 0],
        c["kv"][0, 1],
        c["qsl"],
        c["lens"],
        c["table"],
        0.125,
        c["max_q"],
        c["max_len"],
        num_decodes,
    )
    return out


@pytest.mark.parametrize("decode_kernel", ["v1", "v2"])
def test_mixed_step_launches_the_decode_kernel_on_the_decode_rows(decode_kernel):
    k = fake_kernels(decode_kernel)
    c = make_inputs([(1, 300), (1, 20), (1, 2000), (37, 100), (5, 5)], tail=3)
    T = c["q"].shape[0]
    call(k, c, num_decodes=3)
    launches = [x for x in k.log if x[0] != "combine"]
    assert [name for name, _, _ in launches] == ["decode_g4", "prefill"]
    (_, dgrid, dargs), (_, pgrid, pargs) = launches
    assert dgrid[2] == 3 and dgrid[1] == 2  # 3 decode sequences, 2 kv heads x 1 slice
    assert pgrid == (1, 8, 2)  # one 64-row tile of 37 rows, 8 query heads, the 2 prefill sequences
    qsl, lens, bt = c["qsl"].data_ptr(), c["lens"].data_ptr(), c["table"].data_ptr()
    assert dargs[4:7] == (qsl, lens, bt)
    # the prefill launch starts at sequence 3: its per-sequence arrays are offset, q/out are not
    assert pargs[4:7] == (qsl + 12, lens + 12, bt + 3 * c["table"].stride(0) * 4)
    assert pargs[0:2] == dargs[0:2]
    # only the last launch zeroes the padding tail (num_tokens argument), the decode launch passes 0
    ntok_at = -2 if decode_kernel == "v1" else -3  # v2 takes min_part after it
    assert dargs[ntok_at] == 0 and pargs[-2] == T
    # the table's row stride travels as the kernels' last argument
    assert dargs[-1] == pargs[-1] == c["table"].stride(0)


def test_decode_step_and_unknown_decodes_take_one_kernel_each():
    k = fake_kernels()
    c = make_inputs([(1, 300), (1, 20), (1, 2000)])
    call(k, c, num_decodes=0)  # max_query_len 1: a pure decode step
    assert [x[0] for x in k.log if x[0] != "combine"] == ["decode_g4"]
    k.log.clear()
    c = make_inputs([(1, 300), (9, 20)])
    call(k, c, num_decodes=0)  # decodes not announced: everything through the prefill kernel
    assert [x[0] for x in k.log] == ["prefill"]


def test_strided_block_table_is_not_copied():
    """The runner hands a column slice of its wider buffer: the kernels get its pointer and row stride."""
    k = fake_kernels()
    c = make_inputs([(1, 300), (40, 40)], table_pad=11)
    assert not c["table"].is_contiguous()
    call(k, c, num_decodes=1)
    for name, _, args in k.log:
        if name != "combine":
            assert args[6] in (c["table"].data_ptr(), c["table"].data_ptr() + c["table"].stride(0) * 4)
            assert args[-1] == c["table"].stride(0) == c["table"].shape[1] + 11


def test_launches_over_65535_sequences_are_chunked():
    k = fake_kernels("v1")
    B = 66_000
    c = dict(
        q=torch.zeros(B, 8, 64, dtype=torch.bfloat16),
        kv=torch.zeros(1, 2, 4, 16, 2, 64, dtype=torch.bfloat16),
        qsl=torch.arange(B + 1, dtype=torch.int32),
        lens=torch.ones(B, dtype=torch.int32),
        table=torch.ones(B, 1, dtype=torch.int32),
        max_q=1,
        max_len=1,
    )
    call(k, c, num_decodes=0)
    decodes = [x for x in k.log if x[0].startswith("decode")]
    assert [grid[2] for _, grid, _ in decodes] == [65_535, 465]
    assert all(grid[2] <= 65_535 and grid[1] <= 65_535 for _, grid, _ in k.log)
    assert decodes[1][2][4] == c["qsl"].data_ptr() + 4 * 65_535
    assert decodes[0][2][-2] == 0 and decodes[1][2][-2] == B  # the tail is zeroed once, by the last launch


def test_split_plan_uses_the_measured_occupancy():
    k = fake_kernels("v2", occupancy={1: 4, 2: 4, 4: 3, 8: 2})
    plan = k.decode_plan(1, 32, 8, 2048)  # B=1, 32k context, GQA-4
    assert plan.group == 4 and plan.slices == 1
    assert 8 * plan.splits <= 3 * 132  # within one wave at 3 CTAs per SM
    k.decode_ctas_per_sm = 12  # the old assumption: more than a wave
    assert k.decode_plan(1, 32, 8, 2048).splits == 64


# ---- 6. no silent reference inside graph capture -------------------------------------------------


def test_declined_inputs_run_the_reference_eagerly_and_raise_inside_capture(monkeypatch, caplog):
    k = fake_kernels()
    c = make_inputs([(1, 300), (1, 20)])
    T, H, D = c["q"].shape
    padded = torch.zeros(T, H * D + 1, dtype=c["q"].dtype)
    padded[:, 1:] = c["q"].reshape(T, H * D)
    c["q"] = torch.as_strided(padded, (T, H, D), (H * D + 1, D, 1), 1)  # misaligned rows: declined
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level(logging.WARNING, logger="compiler.kernels.cutlass_ops"):
        out = call(k, c, 0)
    assert k.log == [] and "16-byte" in caplog.text
    ref = paged_attention_reference(
        c["q"], c["kv"][0, 0], c["kv"][0, 1], c["qsl"], c["lens"], c["table"], 0.125, 1, 300
    )
    assert torch.equal(out, ref)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="captured CUDA graph"):
        call(k, c, 0)
    with pytest.raises(RuntimeError, match="captured CUDA graph"):
        k.write_kv(
            c["q"][:, :2].float(),
            c["q"][:, :2].float(),
            c["kv"][0, 0],
            c["kv"][0, 1],
            torch.zeros(c["q"].shape[0], dtype=torch.int64),
        )


def test_a_released_handle_is_a_clear_error():
    k = fake_kernels()
    handle = k.handle
    assert cutlass_ops.kernels_by_handle(handle) is k
    del k
    with pytest.raises(RuntimeError, match="not loaded"):
        cutlass_ops.kernels_by_handle(handle)


# ---- the CPU path: one kernel for decodes and chunks, whatever num_decodes says --------------------


@pytest.mark.parametrize(
    "seqs,num_decodes",
    [
        ([(1, 40), (1, 7), (1, 90), (12, 30), (3, 3)], 3),
        ([(1, 40), (1, 7), (1, 90), (12, 30), (3, 3)], 0),
        ([(1, 40), (1, 7), (1, 90)], 0),
    ],
)
def test_cpu_path_attends_decodes_and_chunks_like_the_reference(seqs, num_decodes):
    c = make_inputs(seqs, seed=3)
    c["q"], c["kv"] = c["q"].float(), c["kv"].float()
    out = torch.zeros_like(c["q"])
    torch.ops.kiln.paged_attention_cpu(
        out, c["q"], c["kv"], 0, c["qsl"], c["lens"], c["table"], 0.125, c["max_q"], c["max_len"], num_decodes
    )
    ref = paged_attention_reference(
        c["q"], c["kv"][0, 0], c["kv"][0, 1], c["qsl"], c["lens"], c["table"], 0.125, c["max_q"], c["max_len"]
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


# ---- 5. capability check, model features and kernel settings at backend choice -------------------


def _cuda_spec(tmp_path, **kw):
    return BackendSpec(
        device=torch.device("cuda", 0),
        dtype=torch.bfloat16,
        head_dim=64,
        block_size=16,
        kernel_cache_dir=tmp_path / "kernels",
        compile=True,
        **kw,
    )


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA GPU of a given compute capability is present."""

    def set_capability(cap):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    return set_capability


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_auto_on_a_gpu_other_than_sm90_takes_the_torch_backend_with_one_log_line(tmp_path, fake_gpu, caplog, cap):
    fake_gpu(cap)
    with caplog.at_level(logging.INFO, logger="engine.layers.attention.selector"):
        backend = get_attention_backend("auto", _cuda_spec(tmp_path))
    assert backend.name == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.layers.attention.selector"]
    assert len(lines) == 1 and f"sm_{cap[0]}{cap[1]}" in lines[0] and "sm_90a" in lines[0]
    with pytest.raises(RuntimeError, match="sm_90a only"):
        get_attention_backend("cutlass", _cuda_spec(tmp_path))


def test_sm90_without_built_kernels_names_the_build_command(tmp_path, fake_gpu, caplog):
    fake_gpu((9, 0))
    reason = cutlass_backend.cutlass_unavailable_reason(_cuda_spec(tmp_path))
    assert reason is not None and "kiln build-kernels" in reason
    with caplog.at_level(logging.INFO, logger="engine.layers.attention.selector"):
        assert get_attention_backend("auto", _cuda_spec(tmp_path)).name == "torch"
    assert "kiln build-kernels" in caplog.text


def test_windowed_or_capped_models_are_not_given_to_the_kernels(tmp_path, fake_gpu):
    fake_gpu((9, 0))
    spec = _cuda_spec(tmp_path, windowed_or_capped=True)
    assert "sliding-window" in cutlass_backend.cutlass_unavailable_reason(spec)
    assert get_attention_backend("auto", spec).name == "torch"
    with pytest.raises(ValueError, match="sliding-window or soft-capped"):
        get_attention_backend("cutlass", spec)


def _fake_cache(cache: Path, names: list[str]) -> None:
    """An index holding exactly `names`, with current source hashes (what a build writes)."""
    from compiler.kernels.build import INDEX_NAME, source_hash
    from compiler.kernels.manifest import load_manifest, render

    manifest = load_manifest()
    cache.mkdir(parents=True)
    index = {}
    for n in names:
        (cache / f"{n}.cubin").write_bytes(b"\0")
        index[n] = {"cubin": f"{n}.cubin", "source_hash": source_hash(manifest[n], render(manifest[n]))}
    (cache / INDEX_NAME).write_text(json.dumps(index))


def test_only_the_selected_kernel_generation_is_required(tmp_path, fake_gpu):
    fake_gpu((9, 0))
    _fake_cache(
        tmp_path / "kernels", ["write_kv_bf16", "paged_decode_v2_bf16_d64_b16", "flash_prefill_wgmma_bf16_d64_b16"]
    )
    new = _cuda_spec(tmp_path, decode_kernel="v2", prefill_kernel="wgmma")
    assert cutlass_backend.cutlass_unavailable_reason(new) is None
    old = _cuda_spec(tmp_path)  # v1 + mma: not built in this cache
    assert "paged_decode_bf16_d64_b16" in cutlass_backend.cutlass_unavailable_reason(old)
    assert cutlass_ops.required_variants(torch.bfloat16, 64, 16, "v2", "wgmma") == [
        "write_kv_bf16",
        "paged_decode_v2_bf16_d64_b16",
        "flash_prefill_wgmma_bf16_d64_b16",
    ]
    with pytest.raises(ValueError, match="decode_kernel"):
        cutlass_ops.required_variants(torch.bfloat16, 64, 16, "v3", "mma")


def test_kernel_choice_is_a_setting(monkeypatch):
    from pydantic import ValidationError

    from engine.config.settings import EngineSettings

    assert (EngineSettings().decode_kernel, EngineSettings().prefill_kernel) == ("v1", "mma")
    monkeypatch.setenv("KILN_DECODE_KERNEL", "v2")
    monkeypatch.setenv("KILN_PREFILL_KERNEL", "wgmma")
    s = EngineSettings()
    assert (s.decode_kernel, s.prefill_kernel) == ("v2", "wgmma")
    with pytest.raises(ValidationError):
        EngineSettings(decode_kernel="v3")
    assert not hasattr(cutlass_ops, "USE_DECODE_V2") and not hasattr(cutlass_ops, "USE_WGMMA_PREFILL")
    assert not hasattr(cutlass_ops, "_REGISTRY")
