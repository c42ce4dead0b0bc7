"""`kiln make-draft-model`'s draft models (engine/training/draft_distill.py, eagle_training.py): the draft vocabulary
it picks, and drafts trained on a labelled corpus (the target's top-k log-probabilities at each
answer position, as build_labelled_corpus records them) that kiln loads as draft models with
their draft vocabulary, whose greedy output stays plain decoding's. Tiny models, seconds."""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.training.draft_distill import cut_layers, distill_draft_model, distill_from_target, draft_vocabulary


def _entry(ids: list[int], prompt: int, top_ids: list[list[int]]) -> dict:
    return {
        "ids": torch.tensor(ids),
        "prompt": prompt,
        "top_ids": torch.tensor(top_ids, dtype=torch.int32),
        "top_lp": torch.full((len(top_ids), len(top_ids[0])), -1.0, dtype=torch.float16),
    }


def test_draft_vocabulary_takes_the_used_tokens_then_the_lowest_ids():
    corpus = [_entry([1, 2, 50, 50, 60], 2, [[50, 7], [50, 60], [60, 7]])]  # answer 50 50 60, labels 50 7 60
    # used: 50 (4x), 60 (3x), 7 (2x); prompt tokens 1, 2 do not count
    assert draft_vocabulary(corpus, 2, 100).tolist() == [50, 60]
    assert draft_vocabulary(corpus, 5, 100).tolist() == [0, 1, 7, 50, 60]  # filled with 0, 1
    assert draft_vocabulary(corpus, 100, 100).tolist() == list(range(100))


@pytest.fixture(scope="module")
def labelled(tiny_models):
    """A labelled corpus of the tiny llama: its greedy answers to a few prompts and its top-8
    log-probabilities at every answer position (computed by transformers here)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    corpus = []
    with torch.no_grad():
        for i in range(6):
            prompt = [10 + i, 20 + 3 * i, 30 + i, 7]
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0]
            lp = hf(ids[None]).logits[0, len(prompt) - 1 : -1].log_softmax(-1).topk(8)
            corpus.append(
                {"ids": ids, "prompt": len(prompt), "top_ids": lp.indices.to(torch.int32), "top_lp": lp.values.half()}
            )
    return corpus


def test_cut_layers_keeps_the_target_layers_asked_for(tiny_models):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    n = hf.config.num_hidden_layers
    draft = cut_layers(hf, [n - 1])
    assert draft.config.num_hidden_layers == 1 and hf.config.num_hidden_layers == n
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, hf.model.layers[n - 1].mlp.up_proj.weight)
    assert draft.model.layers[0].mlp.up_proj.weight is not hf.model.layers[n - 1].mlp.up_proj.weight
    with pytest.raises(ValueError, match="ascending, distinct"):
        cut_layers(hf, [1, 0])


@pytest.mark.parametrize("init", ["scratch", "target"])
def test_trained_draft_loads_with_its_vocabulary_and_output_stays_exact(
    tiny_models, labelled, make_llm, tmp_path, init
):
    target = tiny_models["llama"]
    out = tmp_path / "draft"
    if init == "scratch":
        distill_draft_model(
            str(target), labelled, out, layers=1, hidden=64, draft_vocab=64, epochs=1, batch=4, log=lambda _: None
        )
    else:
        distill_from_target(
            str(target), labelled, out, [0, 1], draft_vocab=64, frozen=1, epochs=1, batch=4, log=lambda _: None
        )
    vocab = json.loads((out / "draft_vocab.json").read_text())["token_ids"]
    assert len(vocab) == 64 and vocab == sorted(vocab)
    used = {int(t) for c in labelled for t in c["top_ids"].flatten()}
    assert len(used) > 64 and set(vocab) <= used  # the most used of the corpus's tokens
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[11, 25, 31, 7], [40, 41, 42]]
    want = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, greedy, use_tqdm=False)]
    llm = make_llm(target, speculative_method="draft_model", speculative_model=str(out), num_speculative_tokens=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.engine.core.scheduler.num_draft_tokens > 0
    info = json.loads((out / "kiln_training.json").read_text())
    assert info["init"] == init and info["answers"] == len(labelled)


def test_eagle3_head_trained_on_the_labelled_corpus_drafts_and_output_stays_exact(
    tiny_models, labelled, make_llm, tmp_path
):
    """kiln make-draft-model's EAGLE-3 path on the tiny llama: the teacher pass over the labelled
    corpus's sequences, one epoch of training, and the head loaded by kiln: the target (on the CPU
    decoder stack, which hands the head its hidden states) keeps plain decoding's greedy output."""
    from engine.training.eagle_training import train_eagle_for
    from engine.training.teacher import teacher_pass

    target = tiny_models["llama"]
    corpus = [(c["ids"].tolist(), c["prompt"]) for c in labelled]
    teacher = teacher_pass(str(target), [ids for ids, _ in corpus], tmp_path / "teacher.pt", log=lambda _: None)
    out = train_eagle_for(
        str(target),
        corpus,
        teacher,
        tmp_path / "eagle3",
        version=3,
        epochs=1,
        draft_vocab=64,
        batch=4,
        log=lambda _: None,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["eagle_aux_hidden_state_layer_ids"] == list(teacher.aux_layers)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[11, 25, 31, 7], [40, 41, 42]]
    want = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, greedy, use_tqdm=False)]
    llm = make_llm(
        target, speculative_method="eagle3", speculative_model=str(out), num_speculative_tokens=2, enforce_eager=False
    )  # (the CPU's default: fused ops and the decoder stack)
    model = llm.engine.core.runner.model
    assert model.aux_layers and model.cpu_stack is not None  # EAGLE-3's target runs as the one C++ call
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.engine.core.scheduler.num_draft_tokens > 0
