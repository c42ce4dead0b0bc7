"""The eager CPU forward in oneDNN row buckets (LlamaForCausalLM.padded_rows): the hidden states of
every real row are bit-identical to the unpadded forward's (same bucket shapes, row-independent
ops, padding rows claimed by no sequence), the KV cache gets the same writes, and the padding
rows never reach the caller."""

from __future__ import annotations

import pytest
import torch

from compiler.kernels import cpu_linear
from engine.layers.attention.base import AttentionMetadata
from engine.layers.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not cpu_linear._ONEDNN, reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def fused_llm(tiny_llama, tmp_path_factory):
    from engine.entrypoints.llm import LLM

    llm = LLM(model=str(tiny_llama), max_num_seqs=64, device="cpu", enforce_eager=True, num_gpu_blocks=512)
    model = llm.engine.core.runner.model
    model.use_cpu_fused_ops(tmp_path_factory.getbasetemp() / "kiln-cache" / "compile")
    assert model.pad_cpu_rows
    return llm


def _decode_meta(rows: int, block_size: int, seed: int) -> tuple[AttentionMetadata, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (rows,), generator=g, dtype=torch.int32)
    per_seq = -(-40 // block_size)
    tables = torch.arange(rows * per_seq, dtype=torch.int32).view(rows, per_seq)
    pos = (lens - 1).long()
    slots = tables.gather(1, (pos // block_size)[:, None].long()).view(-1).long() * block_size + pos % block_size
    meta = AttentionMetadata(slots, torch.arange(rows + 1, dtype=torch.int32), lens, tables, 1, 40, rows)
    return meta, pos


@pytest.mark.parametrize("cpp_attention", [True, False], ids=["cpp-attention", "reference-attention"])
@pytest.mark.parametrize("rows", [33, 41, 64, 70])
def test_padded_forward_equals_unpadded(fused_llm, rows, cpp_attention):
    runner = fused_llm.engine.core.runner
    model, cache = runner.model, runner.kv_cache.tensor
    model.set_backend(TorchAttentionBackend(compiled_cpu_decode=cpp_attention))
    meta, pos = _decode_meta(rows, cache.shape[3], rows)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    assert model.padded_rows(rows, model.embed_tokens.weight, None) == cpu_linear.row_bucket(rows)
    results = {}
    with torch.inference_mode():
        for pad in (False, True):
            model.pad_cpu_rows = pad
            cache.normal_(generator=torch.Generator().manual_seed(0))
            hidden = model(ids, pos, cache, meta)
            results[pad] = (hidden.clone(), model.compute_logits(hidden[:rows]), cache.clone())
    model.pad_cpu_rows = True
    (h0, l0, c0), (h1, l1, c1) = results[False], results[True]
    assert h1.shape == (rows, model.config.hidden_size)
    assert torch.equal(h0, h1) and torch.equal(l0, l1) and torch.equal(c0, c1)


def test_no_padding_where_it_cannot_pay(fused_llm):
    model = fused_llm.engine.core.runner.model
    w = model.embed_tokens.weight
    assert model.padded_rows(16, w, None) == 16  # F.linear's rows: no bucket
    assert model.padded_rows(64, w, None) == 64  # already a bucket
    assert model.padded_rows(41, w, torch.zeros(41, 2)) == 41  # LoRA's per-token one-hot
    assert model.padded_rows(41, w.bfloat16(), None) == 41
