"""`kiln chat` (engine/entrypoints/cli/chat.py): against the shared `kiln serve` process with --url,
and with the model in process; each answer is the API's greedy answer to the same conversation
(system prompt, chat template and history included), and Ctrl-C stops an answer between two
engine steps, its request aborted and its KV blocks freed, the partial answer kept."""

from __future__ import annotations

import io
import json
import os
import signal
from types import SimpleNamespace

import pytest

from engine.core.params import SamplingParams
from engine.entrypoints.cli import chat as chat_cli
from engine.entrypoints.cli.chat import STOPPED, LocalChat, Sampling, repl
from engine.entrypoints.cli.main import main
from tests.support.server import API_KEY, MAX_MODEL_LEN, MODEL, metrics, wait_clean

ABORTED = "kiln:request_success_total{finished_reason=abort}"

GREEDY = ["--temperature", "0", "--max-tokens", "8"]


def chat(monkeypatch, capsys, argv: list[str], typed: str) -> str:
    monkeypatch.setattr("sys.stdin", io.StringIO(typed))
    assert main(["chat", *argv]) == 0
    return capsys.readouterr().out


def greedy_answers(client, turns: list[str], system: str | None = None) -> list[str]:
    conversation = [{"role": "system", "content": system}] if system else []
    out = []
    for text in turns:
        conversation.append({"role": "user", "content": text})
        got = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0, max_tokens=8)
        out.append(got.choices[0].message.content)
        conversation.append({"role": "assistant", "content": out[-1]})
    return out


def test_chat_with_a_server(url, client, monkeypatch, capsys):
    argv = ["--url", url, "--api-key", API_KEY, "--system", "You are kiln.", *GREEDY]
    out = chat(monkeypatch, capsys, argv, "Hello there\nAnd again\n/exit\nnot read\n")
    first, second = greedy_answers(client, ["Hello there", "And again"], system="You are kiln.")
    assert out.startswith(f"kiln chat with {MODEL}:")
    assert out.endswith(f"> {first}\n> {second}\n> "), out


def test_chat_with_the_model_in_process(tiny_llama, url, client, monkeypatch, capsys):
    argv = [str(tiny_llama), "--device", "cpu", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), *GREEDY]
    out = chat(monkeypatch, capsys, argv, "Hello there\nAnd again\n/reset\nHello there\n")  # (ends at EOF)
    first, second = greedy_answers(client, ["Hello there", "And again"])
    assert out.endswith(f"> {first}\n> {second}\n> > {first}\n> \n"), out


def test_server_errors_are_shown_and_the_turn_dropped(url, monkeypatch, capsys):
    argv = ["--url", url, "--api-key", API_KEY, "--max-tokens", str(10 * MAX_MODEL_LEN)]
    out = chat(monkeypatch, capsys, argv, "Hello\n")
    assert "> error: 400: " in out and "max_tokens" in out, out
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", "--url", url, "--api-key", "wrong"]) == 2
    assert "401" in capsys.readouterr().err


def test_ctrl_c_stops_the_answer_and_a_second_quits_freeing_its_blocks(make_llm):
    llm = make_llm(max_model_len=256, max_num_seqs=1)
    backend = LocalChat(llm)
    asked: list[list[dict]] = []
    real_stream = backend.stream

    def stream(messages, sampling):
        asked.append([dict(m) for m in messages])
        return real_stream(messages, sampling)

    backend.stream = stream
    typed = iter(["Tell me a story", "Go on"])
    written: list[str] = []

    def write(text: str) -> None:
        written.append(text)
        if len(asked) == 1 and len(written) == 3:  # the banner and two pieces of the first answer
            os.kill(os.getpid(), signal.SIGINT)  # (the stop lands between two engine steps)

    def read(prompt: str) -> str:
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    repl(backend, Sampling(temperature=0, max_tokens=200), read=read, write=write)
    stopped_at = written.index(STOPPED)
    partial = "".join(written[1:stopped_at])
    assert 2 <= stopped_at <= 4 and partial  # stopped at once, not after 200 tokens
    assert not llm.engine.core.has_unfinished_requests() and llm.engine.core.pool.is_fully_free()
    assert asked[1][-2:] == [
        {"role": "assistant", "content": partial},
        {"role": "user", "content": "Go on"},
    ]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    # A second Ctrl-C before the answer has stopped (a long step) quits: KeyboardInterrupt,
    # raised inside the step, after its forward and before its results are applied (the worst
    # place). On the way out the request is aborted: no request left, every block free, and the
    # engine answers the next request as before.
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in llm.generate(["Once upon a time"], greedy)]
    scheduler = llm.engine.core.scheduler
    real_update = scheduler.update_from_output

    def update(*args, **kwargs):
        if len(written) > 2:  # mid-answer
            os.kill(os.getpid(), signal.SIGINT)  # stops the answer at its next piece ...
            os.kill(os.getpid(), signal.SIGINT)  # ... unless a second comes first: raised here
        return real_update(*args, **kwargs)

    scheduler.update_from_output = update
    written.clear()
    try:
        with pytest.raises(KeyboardInterrupt):
            repl(backend, Sampling(temperature=0, max_tokens=200), read=lambda prompt: "Tell me a story", write=write)
    finally:
        del scheduler.update_from_output
    assert STOPPED not in written and len(written) <= 4
    assert not llm.engine.core.has_unfinished_requests() and llm.engine.core.pool.is_fully_free()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert [o.outputs[0].token_ids for o in llm.generate(["Once upon a time"], greedy)] == want


def test_a_second_ctrl_c_quits_and_the_server_frees_the_request(url, monkeypatch, capsys):
    """With --url: Ctrl-C twice while an answer streams (the second before the first has stopped
    it, raised inside the stream's read) ends `kiln chat` with status 130; the connection closes on
    the way out, so the server aborts the request and frees its blocks."""
    aborted = metrics(url).get(ABORTED, 0)
    chunks: list[str] = []

    def loads(text: str):
        chunks.append(text)
        if len(chunks) == 3:  # two pieces of the answer shown
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return json.loads(text)

    monkeypatch.setattr(chat_cli, "json", SimpleNamespace(loads=loads))
    monkeypatch.setattr("sys.stdin", io.StringIO("Tell me a long story\n/exit\n"))
    argv = ["chat", "--url", url, "--api-key", API_KEY, "--temperature", "0", "--max-tokens", "500"]
    assert main(argv) == 130
    assert STOPPED not in capsys.readouterr().out and len(chunks) == 3
    wait_clean(url)  # nothing running, waiting or holding KV blocks
    assert metrics(url)[ABORTED] == aborted + 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("argv", [["m", "--url", "http://127.0.0.1:9"], ["--url", "http://127.0.0.1:9"]])
def test_bad_arguments_are_one_line_errors(argv, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln chat: ") and err.count("\n") == 1, err
