"""Fault isolation: one request's failure (logits processor, NaN logits, tokenizer) fails only it."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.admission_rules import InvalidRequestError
from engine.core.outputs import FinishReason
from engine.core.params import SamplingParams
from engine.worker.sample.sampler import Sampler, SampleRow

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43, 44]]


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def raise_on_third(out_ids, row):
    if len(out_ids) == 2:
        raise RuntimeError("boom")
    return row


def nan_row(out_ids, row):
    return torch.full_like(row, math.nan) if len(out_ids) == 1 else row


def wrong_shape(out_ids, row):
    return row[:3]


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    from engine.entrypoints.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", enforce_eager=True, max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.mark.parametrize(
    "processor, message",
    [
        (raise_on_third, "logits processor failed: RuntimeError: boom"),
        (nan_row, "non-finite logits"),
        (wrong_shape, "logits processor failed: TypeError"),
    ],
)
def test_a_failing_row_fails_only_its_request(make_llm, baseline, processor, message):
    llm = make_llm(max_model_len=64)
    params = [greedy() for _ in PROMPTS]
    params[1] = greedy(logits_processors=[processor])
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == FinishReason.ERROR.value
    assert message in bad.error
    assert -1 not in bad.outputs[0].token_ids
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == baseline[i]


def test_failing_sample_of_n_fails_its_whole_request(make_llm, baseline):
    llm = make_llm(max_model_len=64)
    params = [greedy() for _ in PROMPTS]
    params[2] = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True, logits_processors=[raise_on_third])
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(c.finish_reason == "error" for c in outs[2].outputs) and "boom" in outs[2].error
    assert [outs[i].outputs[0].token_ids for i in (0, 1, 3)] == [baseline[i] for i in (0, 1, 3)]


def test_a_processor_that_changes_tokens_is_applied(make_llm):
    llm = make_llm(max_model_len=64)

    def force_7(out_ids, row):
        row = row.clone()
        row[7] = row.max() + 1.0
        return row

    out = llm.generate([PROMPTS[0]], greedy(4, logits_processors=[force_7]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7, 7, 7, 7]


def test_processors_must_be_callable():
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=["not callable"])


def _failing_backend(backend, marker: int):
    """A copy of a fast tokenizer's `tokenizers.Tokenizer` whose decoder fails on any text holding
    the token `marker`, wherever it is decoded from (DecodeStream or decode)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import Decoder

    broken = Tokenizer.from_str(backend.to_str())
    real, piece = broken.decoder, broken.id_to_token(marker)

    class Failing:
        def decode_chain(self, tokens: list[str]) -> list[str]:
            if piece in tokens:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return [real.decode(tokens)]

    broken.decoder = Decoder.custom(Failing())
    return broken


@pytest.mark.parametrize("path", ["stream", "window"])
def test_tokenizer_failure_fails_only_that_request(make_llm, baseline, path):
    """A tokenizer that fails on one request's text fails only that request, on either path the
    output side decodes by: a fast tokenizer's (kiln's own form or transformers') DecodeStream
    over its `tokenizers.Tokenizer`, which requests take, or the window method's decode (a
    tokenizer without one)."""
    llm = make_llm(max_model_len=64)
    tok = llm.engine.tokenizer
    backend = _failing_backend(tok.backend_tokenizer, marker=PROMPTS[3][-1])

    class Broken:
        backend_tokenizer = backend if path == "stream" else None

        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, skip_special_tokens=False):
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    llm.engine.tokenizer = Broken()
    assert (llm.engine.outputs.detokenizer.backend is backend) == (path == "stream")
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert outs[3].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in outs[3].error
    assert [outs[i].outputs[0].token_ids for i in range(3)] == baseline[:3]
    assert all(outs[i].error is None for i in range(3))


def test_fail_all_requests_after_a_crash_leaves_nothing_hanging(make_llm):
    llm = make_llm(max_model_len=64, preemption_mode="swap", num_gpu_blocks=8, swap_space_gb=0.001)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(30), f"req-{i}")
    for _ in range(12):
        eng.step()
    outs = eng.fail_all_requests("engine loop crashed: RuntimeError('CUDA error')")
    assert sorted(o.request_id for o in outs) == [f"req-{i}" for i in range(4)]
    assert all(o.finished and o.error and o.outputs[0].finish_reason == "error" for o in outs)
    assert eng.core.is_idle_and_free()
    # The engine keeps serving afterwards.
    assert llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_sampler_marks_non_finite_rows_without_touching_the_others():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,))
    logits = torch.randn(4, 16)
    logits[1, 3] = math.nan
    logits[2] = -math.inf
    rows = [SampleRow(greedy(logprobs=2 if i == 3 else None), [1, 2], 2, 0) for i in range(4)]
    out = sampler(logits, rows)
    assert out.token_ids[1] == out.token_ids[2] == -1 and set(out.errors) == {1, 2}
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[3] == int(logits[3].argmax())
    assert out.logprobs[3] is not None


@pytest.mark.parametrize("eager", [True, False])
def test_stale_nan_in_reused_blocks_does_not_poison_new_requests(make_llm, eager):
    """A failed request can leave non-finite K/V in blocks it returns; the next owner of such a
    block reads only its own slots of it (attention must not multiply stale NaN by 0)."""
    llm = make_llm(enforce_eager=eager, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(20, 30))
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.core.kv_cache.tensor[:, :, 1:].fill_(float("nan"))  # every usable block holds NaN
    after = llm.generate([prompt], params, use_tqdm=False)[0]
    assert after.error is None and after.outputs[0].token_ids == before
