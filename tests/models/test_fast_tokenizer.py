"""kiln's fast form of a tokenizer (engine/models/loader/fast_tokenizer.py): written by the first
load, read by the next without transformers, it encodes, decodes and counts exactly as
transformers' tokenizer of the same files; what it does not do itself is transformers'; a tokenizer
whose decode transformers changes gets no form; a damaged one is rewritten; and a warm engine
generates without importing transformers at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.loader import fast_tokenizer
from engine.models.loader.model_loader import load_tokenizer
from tests.support.tokenizers import TEXTS, assert_same_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def transformers_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def test_the_second_load_is_kilns_form_and_the_same_tokenizer(tiny_llama, transformers_tokenizer, tmp_path):
    first = load_tokenizer(tiny_llama, tmp_path)
    assert not isinstance(first, fast_tokenizer.KilnTokenizer)  # (the first start: transformers')
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert {p.name for p in entry.iterdir()} == {fast_tokenizer.FACTS_FILE, fast_tokenizer.BACKEND_FILE}
    again = load_tokenizer(tiny_llama, tmp_path)
    assert isinstance(again, fast_tokenizer.KilnTokenizer)
    # What kiln calls per request, before anything loads transformers' tokenizer behind it:
    a = transformers_tokenizer
    special = a.all_special_tokens[0] + "x" + a.all_special_tokens[-1]
    for text in TEXTS + [special, "<|im_start|>user\nhi<|im_end|>"]:
        for add in (True, False):
            ids = a.encode(text, add_special_tokens=add)
            assert again.encode(text, add_special_tokens=add) == ids, text
            for skip in (True, False):
                assert again.decode(ids, skip_special_tokens=skip) == a.decode(ids, skip_special_tokens=skip)
    assert again.decode(ids[0]) == a.decode(ids[0])  # (one id)
    assert len(again) == len(a) and again.get_vocab() == a.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token"):
        assert getattr(again, attr) == getattr(a, attr), attr
    assert again._full is None, "encode/decode/len loaded transformers' tokenizer"
    assert_same_tokenizer(a, again)  # (and the rest, through transformers' tokenizer behind it)


def test_a_chat_template_set_by_kiln_reaches_transformers_tokenizer(tiny_llama, tmp_path):
    load_tokenizer(tiny_llama, tmp_path)
    tok = load_tokenizer(tiny_llama, tmp_path)
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"


def test_a_tokenizer_whose_decode_transformers_changes_gets_no_form(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert tok.decode(tok.encode("hello , world")) != backend.decode(tok.encode("hello , world"))
    assert fast_tokenizer.facts_of(tok) is None
    assert not fast_tokenizer.write(tok, tmp_path / "entry") and not (tmp_path / "entry").exists()


def test_a_damaged_form_is_replaced(tiny_llama, tmp_path, caplog):
    load_tokenizer(tiny_llama, tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    (entry / fast_tokenizer.BACKEND_FILE).write_text("{not json")
    with caplog.at_level("WARNING"):
        tok = load_tokenizer(tiny_llama, tmp_path)
    assert "unreadable" in caplog.text and not isinstance(tok, fast_tokenizer.KilnTokenizer)
    assert isinstance(load_tokenizer(tiny_llama, tmp_path), fast_tokenizer.KilnTokenizer)


def test_edited_tokenizer_files_get_a_new_entry(tiny_llama, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    key = fast_tokenizer.dir_entry(src, tmp_path)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["eos_token"] = config.get("bos_token") or "<s>"
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    assert fast_tokenizer.dir_entry(src, tmp_path) != key
    assert fast_tokenizer.dir_entry(src, tmp_path) == fast_tokenizer.dir_entry(src, tmp_path)


def test_a_warm_engine_generates_without_importing_transformers(tiny_llama):
    cache = Path(os.environ["KILN_CACHE_DIR"])  # (the session's: its C++ libraries are there)
    load_tokenizer(tiny_llama, cache)  # (what the first start writes)
    code = (
        "import json, sys\n"
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, device='cpu', enforce_eager=True, max_model_len=128, max_num_seqs=1)\n"
        "params = SamplingParams(max_tokens=4, ignore_eos=True)\n"
        "out = llm.generate(['Hello there'], params, use_tqdm=False)[0].outputs[0]\n"
        "print(json.dumps({'ids': out.token_ids, 'text': out.text, 'transformers': 'transformers' in sys.modules}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["transformers"] is False
    assert len(got["ids"]) == 4
    assert got["text"] == load_tokenizer(tiny_llama).decode(got["ids"], skip_special_tokens=True)
