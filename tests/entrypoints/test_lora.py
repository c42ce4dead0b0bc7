"""LoRA adapters: a batch mixing the base model and two PEFT adapters equals transformers +
PEFT token for token, eager and compiled; each adapter's KV stays in its own prefix-cache
namespace; bad adapters and misuse are clear errors; the server selects adapters by model name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine import LoRARequest, SamplingParams
from engine.core.admission_rules import InvalidRequestError
from tests.support.lora import _make_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 100, 200, 7], [40, 41, 42, 43], list(range(60, 100)), [300, 301]]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": _make_adapter(tiny_llama, root / "a", ["q_proj", "v_proj", "gate_proj", "down_proj"], 4, 1),
        "b": _make_adapter(
            tiny_llama,
            root / "b",
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            8,
            2,
            rslora=True,
        ),
        "wide": _make_adapter(tiny_llama, root / "wide", ["q_proj"], 32, 3),
        "head": _make_adapter(tiny_llama, root / "head", ["lm_head"], 4, 4),
    }


_hf_cache: dict = {}


def _hf_greedy(base_dir, adapter_dir, prompt, max_tokens=10):
    key = (str(adapter_dir), tuple(prompt), max_tokens)
    if key not in _hf_cache:
        import transformers
        from peft import PeftModel

        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.eval().generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _hf_cache[key] = out[0, len(prompt) :].tolist()
    return _hf_cache[key]


def _lora(adapters, name, int_id=1):
    return LoRARequest(name, int_id, adapters[name])


@pytest.mark.parametrize("eager", [True, False])
def test_mixed_batch_equals_peft(eager, tiny_llama, adapters, make_llm):
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=eager, max_num_seqs=8)
    a, b = _lora(adapters, "a", 1), _lora(adapters, "b", 2)
    loras = [None, a, b, a, b, None, a, b]
    prompts = (PROMPTS * 2)[: len(loras)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        want = _hf_greedy(tiny_llama, lora.lora_path if lora else None, prompt)
        assert out.outputs[0].token_ids == want, (lora and lora.lora_name, prompt)
    # and the adapters really change the output
    assert len({tuple(o.outputs[0].token_ids) for o, p in zip(outs, prompts) if p == PROMPTS[0]}) > 1


def test_prefix_cache_is_per_adapter(tiny_llama, adapters, make_llm):
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = list(range(60, 100))  # 40 tokens: 2 full blocks
    a = _lora(adapters, "a")
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0, "the adapter reused KV computed by the base model"
    assert first.outputs[0].token_ids == _hf_greedy(tiny_llama, a.lora_path, prompt)
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert base.outputs[0].token_ids == _hf_greedy(tiny_llama, None, prompt)


def test_unload_and_reload_under_the_same_name(tiny_llama, adapters, make_llm):
    llm = make_llm(enable_lora=True, max_loras=1, max_lora_rank=8)
    prompt = list(range(60, 100))
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, adapters["a"]))
    with pytest.raises(InvalidRequestError, match="unload one"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_lora(adapters, "b", 2))
    llm.engine.core.lora.unload("x")
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, adapters["b"]))[0]
    assert out.num_cached_tokens == 0  # a new adapter under an old name gets a new namespace
    assert out.outputs[0].token_ids == _hf_greedy(tiny_llama, adapters["b"], prompt)


def test_bad_adapters_and_misuse_are_clear_errors(tiny_models, adapters, make_llm, tmp_path):
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="max_lora_rank=8"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=_lora(adapters, "wide"))
    with pytest.raises(InvalidRequestError, match="lm_head"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=_lora(adapters, "head"))
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=LoRARequest("none", 9, str(tmp_path)))
    assert not llm.engine.core.has_unfinished_requests() and llm.engine.core.lora.adapters == []
    plain = make_llm()
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=_lora(adapters, "a"))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_llm(tiny_models["mixtral"], enable_lora=True)


def test_settings_for_lora(adapters):
    from engine.config.settings import EngineSettings

    s = EngineSettings(enable_lora=True, lora_modules=f"a={adapters['a']},b={adapters['b']}", max_loras=2)
    assert s.lora_module_map() == {"a": adapters["a"], "b": adapters["b"]}
    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineSettings(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="name=path"):
        EngineSettings(enable_lora=True, lora_modules=["justaname"])
    with pytest.raises(ValueError, match="max_loras"):
        EngineSettings(enable_lora=True, lora_modules=["a=/x", "b=/y"], max_loras=1)


def test_server_selects_adapters_by_model_name(tiny_llama, adapters):
    import openai

    from tests.support.engine import served

    async def main(state, client):
        models = await client.models.list()
        assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [
            ("base", None),
            ("a", "base"),
            ("b", "base"),
        ]
        for name, path in (("base", None), ("a", adapters["a"]), ("b", adapters["b"])):
            r = await client.completions.create(
                model=name, prompt=PROMPTS[0], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
            )
            want = state.tokenizer.decode(_hf_greedy(tiny_llama, path, PROMPTS[0]))
            assert r.choices[0].text == want.rstrip("\ufffd")  # (a split UTF-8 character at the end is held back)
        with pytest.raises(openai.NotFoundError, match="'base', 'a', 'b'"):
            await client.completions.create(model="c", prompt="hi", max_tokens=2)

    with served(
        tiny_llama,
        {"served_model_name": "base"},
        enable_lora=True,
        max_lora_rank=8,
        lora_modules=[f"a={adapters['a']}", f"b={adapters['b']}"],
    ) as (state, _, client):
        asyncio.run(main(state, client))


def test_runtime_load_and_unload_through_the_server(tiny_llama, adapters):
    import openai

    from tests.support.engine import served

    async def main(state, http, client):
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=2)
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]})
        assert r.status_code == 200 and "added" in r.text
        assert "a" in [m.id for m in (await client.models.list()).data]
        out = await client.completions.create(
            model="a", prompt=PROMPTS[0], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        want = state.tokenizer.decode(_hf_greedy(tiny_llama, adapters["a"], PROMPTS[0]))
        assert out.choices[0].text == want.rstrip("\ufffd")
        for path, body, param in [
            ("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]}, "lora_path"),  # no slot
            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]}, "lora_name"),
            ("/v1/unload_lora_adapter", {"lora_name": "zzz"}, "lora_name"),
        ]:
            bad = await http.post(path, json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]})
        assert r.status_code == 200
        assert [m.id for m in (await client.models.list()).data] == ["base", "b"]

    roots = [str(Path(adapters["a"]).parent)]
    with served(
        tiny_llama,
        {"served_model_name": "base", "allow_runtime_lora_updating": True, "lora_adapter_roots": roots},
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
    ) as (state, http, client):
        asyncio.run(main(state, http, client))


def test_runtime_loading_is_confined_to_the_roots(tiny_llama, adapters, tmp_path):
    """Paths outside the roots, missing, files, too long or looping all get the same 400; names
    are checked; nothing is loaded; no 500."""
    from tests.support.engine import served

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text('{"r": 7}')
    loop = Path(adapters["a"]).parent / "loop"
    loop.symlink_to(loop)
    escape = Path(adapters["a"]).parent / "escape"
    escape.symlink_to(outside)
    probes = [
        "/root",
        "/root/.ssh",
        "/etc/passwd",
        str(outside),
        str(outside / "adapter_config.json"),
        str(Path(adapters["a"]).parent / "missing"),
        str(loop),
        str(escape),
        "x" * 5000,
        "/" + "a/" * 3000,
        str(Path(adapters["a"]) / ".." / ".." / "outside"),
    ]

    async def main(state, http):
        answers = []
        for path in probes:
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": path})
            answers.append((r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]))
        assert set(answers) == {(400, answers[0][1], "lora_path")}, answers
        assert "7" not in answers[0][1]
        for name in ("base", "alias", "two words", "x" * 300):
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapters["a"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", (name, r.text)
        assert state.engine.lora_adapters() == []

    roots = [str(Path(adapters["a"]).parent)]
    with served(
        tiny_llama,
        {"served_model_name": ["base", "alias"], "allow_runtime_lora_updating": True, "lora_adapter_roots": roots},
        enable_lora=True,
        max_lora_rank=8,
    ) as (state, http, _):
        asyncio.run(main(state, http))
    with pytest.raises(ValueError, match="lora_adapter_roots"):
        from engine.config.server_settings import ServerSettings

        ServerSettings(allow_runtime_lora_updating=True)


def test_unloading_an_adapter_in_use_is_refused(tiny_llama, adapters, make_llm):
    llm = make_llm(enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.engine
    lora = engine.core.load_lora("a", adapters["a"])
    engine.add_request(PROMPTS[0], GREEDY, "r", lora_request=lora)
    with pytest.raises(InvalidRequestError, match="in use by 1"):
        engine.core.unload_lora("a")
    while engine.core.has_unfinished_requests():
        engine.step()
    engine.core.unload_lora("a")
    assert engine.core.lora.adapters == []
