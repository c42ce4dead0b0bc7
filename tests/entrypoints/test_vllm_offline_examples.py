"""vLLM's documented offline examples (their shapes, written out in tests/data/vllm_offline/, see
its README) run on kiln with only the import changed: `from vllm import` -> `from engine import`.
vLLM's example model name, `facebook/opt-125m`, is a relative path here, to a tiny checkpoint.
What each prints is checked against what the example asks for: these are the shapes item 4 of the
drop-in issue asks kiln to take (outputs' fields, chat, the prompt forms, get_tokenizer)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "vllm_offline"


@pytest.fixture(scope="module")
def example_dir(tiny_llama, tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("vllm-examples")
    (cwd / "facebook").mkdir()
    (cwd / "facebook" / "opt-125m").symlink_to(tiny_llama, target_is_directory=True)
    return cwd


def run_example(name: str, cwd: Path, monkeypatch, capsys) -> str:
    source = (EXAMPLES / name).read_text()
    kiln = source.replace("from vllm import", "from engine import")
    changed = [(a, b) for a, b in zip(source.splitlines(), kiln.splitlines()) if a != b]
    assert len(changed) == 1 and changed[0][0].startswith("from vllm import")  # the import, nothing else
    monkeypatch.chdir(cwd)
    # Eager on the CPU, as the other tests run (torch.compile's first build takes minutes): set as
    # a deployment would, through kiln's environment, the script left as it is.
    monkeypatch.setenv("KILN_ENFORCE_EAGER", "1")
    monkeypatch.setenv("KILN_DEVICE", "cpu")
    exec(compile(kiln, str(EXAMPLES / name), "exec"), {"__name__": "__main__"})
    return capsys.readouterr().out


def test_basic(example_dir, monkeypatch, capsys):
    out = run_example("basic.py", example_dir, monkeypatch, capsys)
    prompts = ast.literal_eval(re.search(r"prompts = (\[.*?\])", (EXAMPLES / "basic.py").read_text(), re.S).group(1))
    assert re.findall(r"^Prompt:    (.*)$", out, re.M) == [repr(p) for p in prompts]
    texts = re.findall(r"^Output:    (.*)$", out, re.M)
    assert len(texts) == len(prompts) and all(ast.literal_eval(t) for t in texts)


def test_chat(example_dir, tiny_llama, monkeypatch, capsys):
    from transformers import AutoTokenizer

    out = run_example("chat.py", example_dir, monkeypatch, capsys)
    prompts = [ast.literal_eval(p) for p in re.findall(r"^Prompt: (.*)$", out, re.M)]
    # (the texts as repr() wrote them: in double quotes when a text holds a single quote)
    texts = [ast.literal_eval(t) for t in re.findall(r"^Generated text: (.*)$", out, re.M)]
    assert len(prompts) == 11 and len(texts) == 11 and all(isinstance(t, str) and t for t in texts), texts
    # Each output names the conversation as the chat template rendered it (as vLLM's do).
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    rendered = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert prompts == [rendered] * 11


def test_prompt_forms(example_dir, tiny_llama, monkeypatch, capsys):
    from transformers import AutoTokenizer

    out = run_example("prompt_forms.py", example_dir, monkeypatch, capsys)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = [ast.literal_eval(i) for i in re.findall(r"^Prompt token ids: (.*)$", out, re.M)]
    assert ids == [tok.encode(p) for p in ("The capital of France is", "The future of AI is", "Hello, my name is")]
    samples = re.findall(r"^  ([01]): '.*' (\[.*\]) \((length|stop)\)$", out, re.M)
    assert [s[0] for s in samples] == ["0", "1"] * 3
    assert all(0 < len(ast.literal_eval(s[1])) <= 8 for s in samples)
