"""Embeddings: the pooled final hidden states equal transformers' AutoModel (last token and
mean, across prefill chunks, with prefix-cache hits and preemption), and /v1/embeddings
through the official openai client (floats and base64, dimensions, errors)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.core.admission_rules import InvalidRequestError
from engine.core.params import PoolingParams
from tests.support.engine import assert_engine_clean, run_checked

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 6,
    "x",
    "A kiln is a thermally insulated chamber",
]


def _hf_embeddings(model_dir, tokenizer, texts, kind):
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            h = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(h[-1] if kind == "last" else h.mean(0), dim=0))
    return out


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_embeddings_equal_transformers(kind, tiny_llama, make_llm):
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=3, kv_cache_dtype="float32")  # the long text is chunked
    outs = llm.embed(TEXTS, PoolingParams(kind), use_tqdm=False)
    want = _hf_embeddings(tiny_llama, llm.tokenizer, TEXTS, kind)
    for out, ref in zip(outs, want):
        assert out.finished and out.outputs.embedding == out.embedding  # (vLLM's shape)
        torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-4, atol=1e-5)
    again = llm.embed(TEXTS[1:2], PoolingParams(kind), use_tqdm=False)[0]  # a prefix-cache hit for "last"
    assert (again.num_cached_tokens > 0) == (kind == "last")
    torch.testing.assert_close(torch.tensor(again.embedding), want[1], rtol=1e-4, atol=1e-5)
    if kind == "last":  # LLM.score (vLLM's, with an embedding model): the cosine of the pair's embeddings
        cosine = [float(torch.dot(want[0], ref)) for ref in want[1:]]
        one_to_many = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
        assert [s.outputs.score for s in one_to_many] == pytest.approx(cosine, abs=1e-4)
        pairwise = llm.score(TEXTS[:2], TEXTS[2:], use_tqdm=False)
        assert [s.outputs.score for s in pairwise] == pytest.approx(
            [float(torch.dot(want[0], want[2])), float(torch.dot(want[1], want[3]))], abs=1e-4
        )
        with pytest.raises(ValueError, match="one prompt or as many"):
            llm.score(TEXTS[:2], TEXTS[:3])
        with pytest.raises(ValueError, match="classification"):
            llm.classify(TEXTS)


def test_embeddings_beside_generation_and_under_preemption(tiny_llama, make_llm):
    from engine import SamplingParams

    llm = make_llm(num_gpu_blocks=12, block_size=8, max_num_seqs=6, max_model_len=96, kv_cache_dtype="float32")
    engine = llm.engine
    for i in range(4):
        engine.add_request(
            list(range(10 + i, 50 + i)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), f"gen{i}"
        )
    texts = [t[:80] for t in TEXTS]
    for i, text in enumerate(texts):
        engine.add_request(text, None, f"emb{i}", pooling=PoolingParams("mean", dimensions=16))
    got = run_checked(engine)
    assert engine.core.scheduler.num_preemptions > 0
    for i, ref in enumerate(_hf_embeddings(tiny_llama, llm.tokenizer, texts, "mean")):
        # dimensions: the first 16 values of the (unnormalised) mean, then normalised
        ref16 = torch.nn.functional.normalize(ref[:16], dim=0)
        torch.testing.assert_close(torch.tensor(got[f"emb{i}"].embedding), ref16, rtol=1e-4, atol=1e-5)
    assert all(len(got[f"gen{i}"].outputs[0].token_ids) == 40 for i in range(4))
    assert_engine_clean(engine)


def test_bad_pooling_requests(make_llm):
    llm = make_llm(kv_cache_dtype="float32")
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolingParams("max")
    with pytest.raises(InvalidRequestError, match="hidden size"):
        llm.embed(["hi"], PoolingParams(dimensions=10_000), use_tqdm=False)


def test_embeddings_endpoint(tiny_llama):
    import base64

    import numpy as np

    from tests.support.engine import served

    async def main(state, http, client):
        want = _hf_embeddings(tiny_llama, state.tokenizer, TEXTS[:3], "last")
        r = await client.embeddings.create(model="m", input=TEXTS[:3])
        assert [d.index for d in r.data] == [0, 1, 2]
        for d, ref in zip(r.data, want):
            torch.testing.assert_close(torch.tensor(d.embedding), ref, rtol=1e-4, atol=1e-5)
        assert r.usage.prompt_tokens == sum(len(state.tokenizer.encode(t)) for t in TEXTS[:3])
        raw = await http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64", "dimensions": 8})
        vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype=np.float32)
        assert vec.shape == (8,) and abs(float(np.linalg.norm(vec)) - 1) < 1e-5
        ids = await client.embeddings.create(model="m", input=[[5, 6, 7], [8, 9]])
        assert len(ids.data) == 2
        for body, param in [
            ({"input": []}, "input"),
            ({"input": "hi", "dimensions": 4096}, "dimensions"),
            ({"input": [10**9]}, "input"),
        ]:
            resp = await http.post("/v1/embeddings", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text

    with served(tiny_llama, kv_cache_dtype="float32") as (state, http, client):
        asyncio.run(main(state, http, client))


def test_bare_model_checkpoint_serves_embeddings_only(tmp_path, make_llm):
    """A checkpoint of the model without its head (architectures ["LlamaModel"], names without
    "model.", as embedding models like e5-mistral ship) loads, embeds, and refuses to generate."""
    import transformers

    from engine import SamplingParams
    from engine.models.tiny_model import tiny_config, train_tokenizer

    tok = train_tokenizer()
    tok.save_pretrained(tmp_path)
    raw = tiny_config("llama", len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(5)
    transformers.AutoModel.from_config(config).save_pretrained(tmp_path)
    assert "LlamaModel" in (tmp_path / "config.json").read_text()
    llm = make_llm(tmp_path, kv_cache_dtype="float32")
    out = llm.embed(TEXTS[:2], use_tqdm=False)
    for o, ref in zip(out, _hf_embeddings(tmp_path, llm.tokenizer, TEXTS[:2], "last")):
        torch.testing.assert_close(torch.tensor(o.embedding), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="embeddings only"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
