"""Tensor-parallel model shards (engine/distributed): two gloo ranks running a sharded tiny model
give the unsharded model's logits (fp32, ~1e-5) and greedy tokens, for every architecture family
(Llama, Qwen3's q/k norms, Gemma 2's softcaps and windows, MoE with and without a shared expert,
KV heads replicated over ranks, a vocabulary that needs padding, fused checkpoint tensors, GGUF,
dummy weights)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from engine.distributed.parallel import TensorParallel, init_tensor_parallel
from engine.layers.attention.base import AttentionMetadata
from engine.layers.attention.layer import local_heads
from engine.layers.attention.torch_backend import TorchAttentionBackend
from engine.layers.kv_cache import KVCache
from engine.models.config import ModelConfig
from engine.models.loader.model_loader import load_model

BLOCK = 8
PROMPTS = ([5, 17, 33, 2, 9, 41, 7], [12, 3, 60, 61, 62, 8, 9, 10, 11, 99, 100, 101, 102, 103])  # 7 and 14 tokens
DECODES = 5  # the second sequence passes Gemma 2's window of 16


def _load(path: Path, tp: TensorParallel | None, load_format: str = "auto"):
    config = ModelConfig.from_dir(path)
    model = load_model(path, config, torch.float32, torch.device("cpu"), 64, load_format=load_format, tp=tp)
    model.set_backend(TorchAttentionBackend())
    return model


@torch.inference_mode()
def greedy_run(model, tp: TensorParallel | None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A batched prefill of PROMPTS, then DECODES greedy decode steps of both sequences; returns
    each step's logits (last token of each sequence) and the generated tokens."""
    cfg = model.config
    kv = KVCache(cfg.num_layers, 8, BLOCK, local_heads(cfg, tp)[1], cfg.head_dim, torch.float32, torch.device("cpu"))
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    seqs = [list(p) for p in PROMPTS]
    done = [0, 0]  # tokens already in the cache, per sequence
    logits_per_step, generated = [], [[], []]
    for _ in range(DECODES + 1):
        ids, positions, slots, starts = [], [], [], [0]
        for i, seq in enumerate(seqs):
            for pos in range(done[i], len(seq)):
                ids.append(seq[pos])
                positions.append(pos)
                slots.append(int(tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK)
            starts.append(len(ids))
        lens = [len(s) for s in seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(lens),
            num_decodes=2 if done[0] else 0,
        )
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv.tensor, meta)
        logits = model.compute_logits(hidden[torch.tensor(starts[1:]) - 1])
        logits_per_step.append(logits)
        for i, token in enumerate(logits.argmax(-1).tolist()):
            done[i] = len(seqs[i])
            seqs[i].append(token)
            generated[i].append(token)
    return logits_per_step, generated


def _rank_main(rank: int, world: int, init_method: str, models: dict[str, str], out_dir: str) -> None:
    import faulthandler

    faulthandler.enable()  # a rank killed by a signal shows where (pytest captures the children's stderr)
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, init_method, "gloo")
    for name, path in models.items():
        fmt = "dummy" if name.endswith("-dummy") else "auto"
        model = _load(Path(path), tp, fmt)
        logits, tokens = greedy_run(model, tp)
        torch.save(
            {"logits": logits, "tokens": tokens, "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}},
            Path(out_dir) / f"{name}-{rank}.pt",
        )
    # Both ranks are done with every collective before either tears gloo down: a rank that exits
    # while its peer's gloo threads still talk to it can abort ("terminate called without an
    # active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # And no interpreter teardown (engine/executor/tp_worker.py ends the same way): one run in ~12
    # aborted after this function had returned, in a C++ destructor with no Python frame.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def tp_models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    from engine.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tp-models")
    extra = make_tiny_model(
        root / "llama-kv1", arch="llama", seed=7, overrides={"num_key_value_heads": 1, "vocab_size": 517}
    )  # 517: padded to 2 x 259
    models = {arch: tiny_models[arch] for arch in ("llama", "qwen3", "gemma2", "qwen2_moe", "qwen3_moe")}
    models["llama-kv1"] = extra
    # q/k/v and gate/up fused in the checkpoint (ChatGLM): each rank reads its rows of every part.
    from tests.support.glm import GLM_CONFIGS, to_chatglm_layout

    glm = make_tiny_model(
        root / "glm",
        arch="llama",
        seed=11,
        overrides=dict(GLM_CONFIGS["glm"], partial_rotary_factor=0.5, attention_bias=True, rope_scaling=None),
    )
    models["chatglm"] = to_chatglm_layout(glm, root / "chatglm")
    # GGUF: tensors dequantised whole, then sliced.
    from tests.support.gguf_writer import write_gguf

    models["qwen3-gguf"] = write_gguf(tiny_models["qwen3"], root / "qwen3.gguf", "F32")
    models["mixtral-dummy"] = tiny_models["mixtral"]  # dummy weights: each rank's slice of the same draw
    return models


def test_tp2_matches_unsharded(tp_models, tmp_path):
    world = 2
    mp.spawn(
        _rank_main,
        args=(world, f"file://{tmp_path / 'rendezvous'}", {k: str(v) for k, v in tp_models.items()}, str(tmp_path)),
        nprocs=world,
        join=True,
    )
    for name, path in tp_models.items():
        ref_model = _load(path, None, "dummy" if name.endswith("-dummy") else "auto")
        ref_logits, ref_tokens = greedy_run(ref_model, None)
        cfg = ref_model.config
        for rank in range(world):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            assert got["tokens"] == ref_tokens, name
            for step, (a, b) in enumerate(zip(got["logits"], ref_logits)):
                assert a.shape == (2, cfg.vocab_size)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} step {step}: {m}")
            # A shard, not a copy: this rank holds half of every split weight.
            shapes, whole = got["shapes"], dict(ref_model.named_parameters())
            heads, kv_heads = local_heads(cfg, TensorParallel(rank, world))
            assert shapes["layers.0.self_attn.qkv_proj.weight"][0] == (heads + 2 * kv_heads) * cfg.head_dim
            o_proj = "layers.0.self_attn.o_proj.weight"
            assert shapes[o_proj][1] * world == whole[o_proj].shape[1]
            assert shapes["embed_tokens.weight"][0] == -(-cfg.vocab_size // world)
    assert local_heads(ModelConfig.from_dir(tp_models["llama-kv1"]), TensorParallel(1, 2)) == (2, 1)


def test_unshardable_models_and_unsupported_settings_are_refused(tiny_llama):
    import dataclasses

    cfg = ModelConfig.from_dir(tiny_llama)  # 4 heads, 2 KV heads, intermediate 256
    two, four = TensorParallel(0, 2), TensorParallel(3, 4)
    assert local_heads(cfg, None) == (4, 2) and local_heads(cfg, two) == (2, 1) and local_heads(cfg, four) == (1, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        local_heads(cfg, TensorParallel(0, 3))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 3 KV heads"):
        local_heads(dataclasses.replace(cfg, num_heads=6, num_kv_heads=3), two)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not a multiple of the model's 3 KV heads"):
        local_heads(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), four)
    odd_mlp = dataclasses.replace(cfg, num_heads=6, num_kv_heads=6, head_dim=16)
    from engine.models.llama import LlamaForCausalLM

    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's intermediate_size"):
        with torch.device("meta"):
            LlamaForCausalLM(odd_mlp, 16, TensorParallel(0, 3))
    # Refused before any collective runs (no process group here).
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="enable_lora"):
        load_model(tiny_llama, cfg, torch.float32, cpu, 16, load_format="dummy", lora=(2, 8), tp=two)
    with pytest.raises(ValueError, match="quantization"):
        load_model(tiny_llama, cfg, torch.float32, cpu, 16, load_format="dummy", quantization="fp8", tp=two)
    with pytest.raises(ValueError, match="tensor_parallel_size: rank 2 is not in a group of 2"):
        TensorParallel(2, 2)
