"""Beam search: the beams and their scores equal transformers' num_beams search (no EOS, so
both run to max_tokens), offline and through the server's use_beam_search; EOS ends a beam."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.core.admission_rules import InvalidRequestError
from engine.runtime.beam_search import Beam, BeamSearchParams, best, expand

PROMPTS = [[5, 9, 100, 200, 7], [40, 41, 42, 43], list(range(60, 90))]


def _hf_beams(model_dir, prompt, width, max_tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            length_penalty=1.0,
            early_stopping=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return [s[len(prompt) :].tolist() for s in g.sequences], g.sequences_scores.tolist()


def test_beams_equal_transformers(tiny_llama, make_llm):
    llm = make_llm(max_num_seqs=8, kv_cache_dtype="float32")
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        beams, scores = _hf_beams(tiny_llama, prompt, 3, 8)
        assert [c.token_ids for c in out.outputs] == beams
        assert [c.cumulative_logprob / 8 for c in out.outputs] == pytest.approx(scores, abs=1e-4)
        assert all(c.finish_reason == "length" for c in out.outputs)
    assert llm.engine.core.pool.counters.prefix_hits > 0  # beams re-read their shared prefix from the cache


def test_expand_sets_eos_beams_aside_and_ranks_by_length_penalty():
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1.0)
    beams = [Beam([1, 2], 1, -1.0), Beam([1, 3], 1, -2.0)]
    live, done = expand(beams, [{9: -0.1, 4: -0.5}, {5: -0.1, 6: -3.0}], params, eos_token_ids=(9,))
    assert [b.tokens for b in done] == [[1, 2, 9]] and done[0].finished
    assert [b.tokens for b in live] == [[1, 2, 4], [1, 3, 5]]
    ranked = best(done, live, params)  # scores per output token: -0.55, -0.75, -1.05
    assert [b.tokens for b in ranked] == [[1, 2, 9], [1, 2, 4]]
    with pytest.raises(InvalidRequestError):
        BeamSearchParams(beam_width=0, max_tokens=3)


def test_server_use_beam_search(tiny_llama):
    import openai

    from tests.support.engine import served

    async def main(state, client):
        r = await client.completions.create(
            model="m",
            prompt=PROMPTS[:2],
            max_tokens=6,
            n=2,
            logprobs=1,
            extra_body={"use_beam_search": True, "ignore_eos": True},
        )
        assert len(r.choices) == 4 and r.usage.completion_tokens == 24
        for k, prompt in enumerate(PROMPTS[:2]):
            beams, _ = _hf_beams(tiny_llama, prompt, 2, 6)
            texts = [state.tokenizer.decode(b) for b in beams]
            assert [c.text for c in r.choices[2 * k : 2 * k + 2]] == texts
            assert all(len(c.logprobs.tokens) == 6 for c in r.choices[2 * k : 2 * k + 2])
        chat = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            n=2,
            extra_body={"use_beam_search": True},
        )
        assert len(chat.choices) == 2
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model="m", prompt="hi", max_tokens=4, stream=True, extra_body={"use_beam_search": True}
            )

    with served(tiny_llama, max_num_seqs=8) as (state, _, client):
        asyncio.run(main(state, client))
