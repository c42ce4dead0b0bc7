"""Checks that two tokenizers agree (kiln's cached and fast forms against transformers'), on
texts that exercise spaces, unicode, empty input and special tokens."""

from __future__ import annotations

TEXTS = [
    "hello world",
    "  spaces\n\nand a tab\tthen more",
    "Ünïcödé 日本語 🙂",
    "",
    "kiln " * 40,
]
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def assert_same_tokenizer(a, b) -> None:
    for text in TEXTS + [a.all_special_tokens[0] + "x" + a.all_special_tokens[-1]]:
        ids = a(text).input_ids
        assert b(text).input_ids == ids, text
        assert b.encode(text, add_special_tokens=False) == a.encode(text, add_special_tokens=False)
        assert b.decode(ids) == a.decode(ids)
        assert b.decode(ids, skip_special_tokens=True) == a.decode(ids, skip_special_tokens=True)
    assert b.get_vocab() == a.get_vocab() and len(b) == len(a)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "chat_template"):
        assert getattr(b, attr) == getattr(a, attr), attr
    assert b.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False) == a.apply_chat_template(
        CONV, add_generation_prompt=True, tokenize=False
    )
