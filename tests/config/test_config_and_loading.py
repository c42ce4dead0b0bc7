"""Settings sources and start-up validation; checkpoint loading (sharded, dtypes); the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from engine.config.settings import EngineSettings
from engine.core.params import SamplingParams


def test_settings_sources_in_priority_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kiln.toml").write_text("block_size = 32\nmax_num_seqs = 7\nseed = 3\n")
    monkeypatch.setenv("KILN_MAX_NUM_SEQS", "9")
    s = EngineSettings(seed=5)
    assert (s.block_size, s.max_num_seqs, s.seed) == (32, 9, 5)


def test_invalid_settings_name_the_setting():
    with pytest.raises(ValidationError, match="block_size"):
        EngineSettings(block_size=7)
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        EngineSettings(gpu_memory_utilization=1.5)
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        EngineSettings(max_model_len=4096, max_num_batched_tokens=512, enable_chunked_prefill=False)
    with pytest.raises(ValidationError, match="not_a_setting"):
        EngineSettings(not_a_setting=1)


def test_max_model_len_beyond_the_kv_cache_fails_at_start(make_llm, tiny_llama):
    from engine.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_llama), num_gpu_blocks=4, max_model_len=512, device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_llama), max_model_len=10**6, device="cpu")


def test_prompt_beyond_max_model_len_is_rejected_and_nothing_leaks(make_llm):
    from engine import SamplingParams
    from engine.core.admission_rules import InvalidRequestError

    llm = make_llm(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([list(range(5, 70))], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate(["ok", list(range(5, 60))], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[5, 99999]], SamplingParams(max_tokens=2), use_tqdm=False)
    # The engine still serves.
    assert llm.generate(["ok"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def _save_sharded(src, dst, dtype):
    """Re-save a checkpoint as two safetensors shards with an index (as large HF models ship)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n].to(dtype).contiguous() for n in chunk}, str(dst / fname))
        weight_map.update({n: fname for n in chunk})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_bf16_checkpoint_loads_like_the_original(tiny_models, tmp_path, make_llm):
    from engine import SamplingParams

    src = tiny_models["qwen2"]  # tied embeddings + qkv bias
    dst = tmp_path / "sharded"
    _save_sharded(src, dst, torch.bfloat16)
    a = make_llm(src, dtype="bfloat16")
    b = make_llm(dst, dtype="bfloat16")
    for (na, pa), (nb, pb) in zip(a.engine.core.model.named_parameters(), b.engine.core.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert (
        a.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].token_ids
        == b.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_missing_weights_are_named(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.entrypoints.llm import LLM

    dst = tmp_path / "broken"
    _save_sharded(tiny_models["llama"], dst, torch.float32)
    shard = dst / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(dst), device="cpu")


def test_dummy_load_needs_only_a_config(tmp_path):
    from engine import SamplingParams
    from engine.entrypoints.llm import LLM
    from engine.models.tiny_model import make_tiny_model

    d = make_tiny_model(tmp_path / "cfg", arch="qwen3", config_only=True)
    assert not list(d.glob("*.safetensors"))
    llm = LLM(str(d), load_format="dummy", device="cpu")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_default_model_is_made_once(tmp_path):
    from engine.models.tiny_model import default_model_dir

    path = default_model_dir(tmp_path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_cli_generate_and_flags(tiny_llama):
    cmd = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "generate",
        "Hello",
        "--max-tokens",
        "4",
        "--json",
        "--model",
        str(tiny_llama),
        "--device",
        "cpu",
        "--enforce-eager",
        "--max-model-len",
        "128",
        "--enable-prefix-caching",
        "false",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["prompt"] == "Hello" and len(line["token_ids"]) <= 4
    bad = subprocess.run(
        cmd[:4] + ["--block-size", "7", "--model", str(tiny_llama)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "block_size" in bad.stderr


def test_out_of_vocab_stop_token_ids_are_rejected(make_llm):
    from engine import SamplingParams
    from engine.core.admission_rules import InvalidRequestError

    llm = make_llm()
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["Hi"], SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=[10**6]), use_tqdm=False)
    assert info.value.param == "stop_token_ids"
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_chat_template_setting_inline_or_file(make_llm, tmp_path):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for value in (template, str(path)):
        llm = make_llm(chat_template=value)
        out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt_token_ids == llm.tokenizer.encode("<<Hi>>", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template"):
        make_llm(chat_template=str(tmp_path / "missing.jinja"))


def test_unsupported_model_features_are_named():
    from engine.models.config import ModelConfig

    base = dict(
        model_type="phi3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_act="silu",
    )
    ModelConfig.from_dict(base)
    assert ModelConfig.from_dict({**base, "sliding_window": 8}).sliding_window == 8
    assert ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 8}).sliding_window is None
    for extra, words in [
        (dict(partial_rotary_factor=0.0), "partial_rotary_factor"),
        (dict(rope_scaling={"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}), "longrope"),
        (dict(hidden_act="relu"), "hidden_act"),
        (dict(model_type="gpt2"), "gpt2"),
        (
            dict(
                model_type="qwen2", num_hidden_layers=2, sliding_window=8, use_sliding_window=True, max_window_layers=1
            ),
            "some layers",
        ),
    ]:
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_dict({**base, **extra})


def test_gemma3_config_formats():
    """Gemma 3 text configs as hub checkpoints write them (rope_theta + rope_local_base_freq +
    sliding_window_pattern) and as transformers 5 does (rope_parameters per layer type)."""
    from engine.models.config import ModelConfig
    from engine.models.tiny_model import tiny_config

    base = {**tiny_config("gemma3", 512, 1, 2, 0), "num_hidden_layers": 12}
    old = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6)
    cfg = ModelConfig.from_dict(old)
    assert cfg.layer_windows == (16,) * 5 + (0,) + (16,) * 5 + (0,)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.qk_norm, cfg.sandwich_norms) == (1e6, 1e4, True, True)
    new = ModelConfig.from_dict({**base, "layer_types": ["sliding_attention", "full_attention"] * 6})
    assert (new.rope_theta, new.local_rope_theta) == (1e6, 100.0) and new.layer_windows[:2] == (16, 0)
    with pytest.raises(ValueError, match="text-only"):
        ModelConfig.from_dict({**base, "model_type": "gemma3"})
