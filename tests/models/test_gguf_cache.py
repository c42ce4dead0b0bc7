"""The GGUF file's derived config and tokenizer kept on disk (engine/models/loader/gguf_cache.py,
with kiln's fast form of the tokenizer beside it: engine/models/loader/fast_tokenizer.py):
read back they encode, decode and template exactly as transformers' conversion of the file does;
an edited file gets a new entry; a broken entry is rebuilt. And the header reader that keys it
reads what the gguf package reads."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.models.loader import fast_tokenizer, gguf_cache, gguf_file
from tests.support.gguf_writer import write_gguf
from tests.support.tokenizers import assert_same_tokenizer

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_path(tiny_llama, tmp_path_factory):
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf-cache") / "tiny.gguf", "F32")


def _no_conversion(monkeypatch):
    """Converting the file again (transformers reading the GGUF) fails the test from here on."""
    from transformers import AutoConfig, AutoTokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was converted again instead of read from the cache")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)


def test_tokenizer_and_config_round_trip(gguf_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    converted = gguf_file.load_tokenizer(gguf_path)  # (no cache: transformers' conversion)
    config = json.loads(json.dumps(gguf_file.hf_config(gguf_path)))  # (as the cache keeps it)
    first = gguf_file.load_tokenizer(gguf_path, cache)
    assert gguf_file.hf_config(gguf_path, cache) == config
    (entry,) = (cache / "gguf").iterdir()
    assert (entry / "tokenizer").is_dir() and (entry / "config" / "config.json").is_file()
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]  # (no temporary left behind)
    assert_same_tokenizer(converted, first)
    _no_conversion(monkeypatch)
    again = gguf_file.load_tokenizer(gguf_path, cache)
    assert isinstance(again, fast_tokenizer.KilnTokenizer)  # (kiln's form, the first load wrote it)
    assert type(again.transformers_tokenizer) is type(converted)
    assert_same_tokenizer(converted, again)
    assert gguf_file.hf_config(gguf_path, cache) == config
    # a copy of the same file (another path, another mtime) finds the same entry
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_path, copy)
    assert_same_tokenizer(converted, gguf_file.load_tokenizer(copy, cache))
    assert len(list((cache / "gguf").iterdir())) == 1


def test_an_edited_file_gets_a_new_entry(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    path = write_gguf(src, tmp_path / "m.gguf", "F32")
    before = gguf_file.load_tokenizer(path, cache)
    key = gguf_cache.fingerprint(path, gguf_file._header_end(path, gguf_file.read_header(path)[1]))
    # the same file name, rewritten with another chat template and another end-of-sequence token
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.jinja").unlink(missing_ok=True)
    hf = json.loads((src / "config.json").read_text())
    hf["eos_token_id"] = hf["bos_token_id"]
    (src / "config.json").write_text(json.dumps(hf))
    write_gguf(src, path, "F32")
    after = gguf_file.load_tokenizer(path, cache)
    assert gguf_cache.fingerprint(path, gguf_file._header_end(path, gguf_file.read_header(path)[1])) != key
    assert len(list((cache / "gguf").iterdir())) == 2
    assert after.chat_template == config["chat_template"] != before.chat_template
    assert after.eos_token_id == hf["bos_token_id"] != before.eos_token_id
    assert_same_tokenizer(gguf_file.load_tokenizer(path), after)


def test_a_broken_entry_is_rebuilt(gguf_path, tmp_path, caplog):
    cache = tmp_path / "cache"
    converted = gguf_file.load_tokenizer(gguf_path, cache)
    gguf_file.hf_config(gguf_path, cache)
    (entry,) = (cache / "gguf").iterdir()
    (entry / "tokenizer" / "tokenizer.json").write_text("{not json")
    shutil.rmtree(entry / "fast-tokenizer")  # (transformers' entry is what this test breaks)
    (entry / "config" / "config.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        rebuilt = gguf_file.load_tokenizer(gguf_path, cache)
        gguf_file.hf_config(gguf_path, cache)
    assert "rebuilding it" in caplog.text
    assert_same_tokenizer(converted, rebuilt)
    assert json.loads((entry / "config" / "config.json").read_text()) == json.loads(
        json.dumps(gguf_file._transformers_config(gguf_path))
    )
    assert_same_tokenizer(converted, gguf_file.load_tokenizer(gguf_path, cache))


def test_read_header_reads_what_the_gguf_package_reads(gguf_path):
    meta, tensors = gguf_file.read_header(gguf_path)
    reader = gguf.GGUFReader(str(gguf_path))
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue  # (the reader's own: version, counts)
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert field.name not in meta  # (arrays, the vocabulary first, are skipped)
        else:
            assert meta[field.name] == field.contents(), field.name
    assert [(t.name, t.offset, t.nbytes) for t in tensors] == [
        (t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors
    ]
