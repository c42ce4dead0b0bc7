"""dtype=auto on the CPU: the rule (pure), and the engine's choice and log line on real files; auto's
activation path for quantised layers."""

from __future__ import annotations

import logging

import pytest

from engine.worker.cpu_dtype import CpuMath, cpu_auto_dtype, cpu_math

AVX2 = CpuMath(bf16=False, fp16=False, isa="AVX2")
ZEN4 = CpuMath(bf16=True, fp16=False, isa="AVX512")  # AVX512-BF16, no FP16
SPR = CpuMath(bf16=True, fp16=True, isa="AVX512")  # AMX-BF16 and AVX512-FP16: fp16 still runs in bf16


@pytest.mark.parametrize(
    "checkpoint, math, expected",
    [
        ("float32", AVX2, "float32"),
        ("float32", SPR, "float32"),
        (None, ZEN4, "float32"),
        ("bfloat16", AVX2, "float32"),
        ("bfloat16", ZEN4, "bfloat16"),
        ("bfloat16", SPR, "bfloat16"),
        ("float16", AVX2, "float32"),
        ("float16", ZEN4, "bfloat16"),
        ("float16", SPR, "bfloat16"),
        ("quantized", AVX2, "float32"),
        ("quantized", SPR, "float32"),
    ],
)
def test_rule(checkpoint, math, expected):
    dtype, why = cpu_auto_dtype(checkpoint, math)
    assert dtype == expected and why


def test_reasons_say_why():
    assert "no native bf16" in cpu_auto_dtype("bfloat16", AVX2)[1]
    assert "half the bytes" in cpu_auto_dtype("bfloat16", ZEN4)[1]
    assert "rounded to bf16" in cpu_auto_dtype("float16", ZEN4)[1]
    assert "rounded to bf16" in cpu_auto_dtype("float16", SPR)[1]
    assert "native bf16" in ZEN4.describe() and "no native" in AVX2.describe()


def test_this_cpu_is_probed():
    math = cpu_math()
    assert isinstance(math.bf16, bool) and isinstance(math.fp16, bool) and math.isa


def test_engine_logs_its_choice(tiny_llama, tmp_path, caplog):
    """A bf16 checkpoint (the tiny llama's config relabelled) gets the rule's dtype for this CPU,
    and the start-up log names it and why; an explicit dtype is kept as given."""
    import json
    import shutil

    from engine.entrypoints.llm import LLM

    model = tmp_path / "bf16"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(cfg))
    expected, _ = cpu_auto_dtype("bfloat16", cpu_math())
    with caplog.at_level(logging.INFO, logger="engine.resolve"):
        llm = LLM(str(model), device="cpu", enforce_eager=True, max_model_len=64, num_gpu_blocks=16)
    assert str(llm.engine.core.dtype) == f"torch.{expected}"
    assert f"dtype auto on the CPU: {expected}" in caplog.text
    assert (
        str(
            LLM(
                str(model), device="cpu", enforce_eager=True, max_model_len=64, num_gpu_blocks=16, dtype="float32"
            ).engine.core.dtype
        )
        == "torch.float32"
    )


def test_gguf_weight_types_name_the_checkpoint_dtype(tiny_llama, tmp_path):
    """The dtype a GGUF file's layers are stored in: F32/F16 floats, Q8_0 'quantized'."""
    from engine.models.config import ModelConfig
    from engine.resolve.build_target import checkpoint_dtype
    from tests.support.gguf_writer import write_gguf

    for kind, expected in (("F32", "float32"), ("F16", "float16"), ("Q8_0", "quantized")):
        path = write_gguf(tiny_llama, tmp_path / f"m-{kind}.gguf", kind)
        assert checkpoint_dtype(path, ModelConfig.from_dir(path)) == expected


@pytest.mark.parametrize(
    "isa, vendor, family, float_path",
    [
        ("AVX512", "AuthenticAMD", 26, True),  # Zen 5: the float path keeps up with memory
        ("AVX512", "AuthenticAMD", 25, False),  # Zen 4: compute-bound, int8 1.5-2.5x faster
        ("AVX512", "GenuineIntel", 6, False),  # Sapphire Rapids: compute-bound, int8 ~2x faster
        ("AVX2", "AuthenticAMD", 25, False),
        ("AVX2", "GenuineIntel", 6, False),
        ("AVX512", "", 0, False),
    ],
)
def test_quantised_activations_auto(isa, vendor, family, float_path):
    """cpu_quant_activations=auto for a float32 model's quantised layers: float only where measured
    to stream at memory speed; an explicit choice and a reduced-precision model are kept as they are."""
    import torch

    from engine.layers.quant.cpu_packed import activations_choice

    cpu = {"isa": isa, "vendor": vendor, "family": family}
    chosen, why = activations_choice(torch.float32, "auto", **cpu)
    assert chosen is float_path and ("float32 activations" if float_path else "int8 activations") in why
    assert activations_choice(torch.float32, "float", **cpu)[0] is True
    assert activations_choice(torch.float32, "int8", **cpu)[0] is False
    assert activations_choice(torch.bfloat16, "auto", **cpu)[0] is False
    with pytest.raises(ValueError, match="cpu_quant_activations"):
        activations_choice(torch.float32, "int4", **cpu)
