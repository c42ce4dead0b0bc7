"""Large fields validated in bounded pieces on the JSON thread (issue 39, third round, leftovers):
token-id prompts, lists of token id lists, logit_bias, stop strings, guided_choice and one
message's content parts are validated PIECE values at a time with a rest between pieces, and the
final whole-body validation sees only their first item; good bodies validate to exactly what
pydantic makes of them whole, a bad item is a 400 naming the field and its index, and a body of
true/false/null literals is counted before parsing like strings are."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from engine.entrypoints.openai import json_thread
from engine.entrypoints.openai.anthropic_protocol import MessagesRequest
from engine.entrypoints.openai.json_thread import PIECE, PIECE_ERRORS
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from engine.entrypoints.openai.request_body import JSONValueCounter
from tests.support.server import app_states

LONG = 3 * PIECE + 5


class CountingDuty(json_thread.DutyCycle):
    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        super().tick()


GOOD = [
    (CompletionRequest, {"prompt": list(range(LONG)), "max_tokens": 2, "truncate_prompt_tokens": 8}),
    (CompletionRequest, {"prompt": [[1, 2, 3]] * LONG, "logit_bias": {str(i): i % 7 - 3 for i in range(LONG)}}),
    (CompletionRequest, {"prompt": ["a", "b"] * LONG, "stop": [f"s{i}" for i in range(LONG)], "n": 2}),
    (
        CompletionRequest,
        {"prompt": "hi", "guided_choice": [f"c{i}" for i in range(LONG)], "stop_token_ids": [1] * LONG},
    ),
    (EmbeddingRequest, {"input": [list(range(40))] * LONG}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * LONG}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi", "extra": [True] * LONG}] * 3}),
    (
        MessagesRequest,
        {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * LONG},
    ),
]


@pytest.mark.parametrize("model, body", GOOD, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(GOOD)])
def test_pieces_validate_to_what_pydantic_makes_of_the_whole(model, body):
    duty = CountingDuty()
    short, whole = json_thread._in_pieces(model, body, duty, ("body",))
    assert whole, "no field was validated in pieces"
    for name in whole:  # the final validation sees one item of each long field
        key = model.model_fields[name].alias or name
        assert len(short[key]) == 1, key
    got = json_thread._validated(model, body, CountingDuty(), ("body",))
    want = model.model_validate(body)
    assert got == want and got.model_fields_set == want.model_fields_set
    assert duty.ticks >= LONG // PIECE, duty.ticks  # (a rest after each piece at the latest)


def test_a_bad_item_is_located_and_its_errors_bounded():
    def bad(model, body):
        with pytest.raises(json_thread.BadPiece) as exc:
            json_thread._validated(model, body, CountingDuty(), ("body",))
        return exc.value.errors

    ids = list(range(LONG))
    ids[2 * PIECE + 3] = "x"
    errors = bad(CompletionRequest, {"prompt": ids})
    assert [e["loc"] for e in errors] == [("body", "prompt", 2 * PIECE + 3)], errors
    nested = [[1, 2]] * LONG
    nested[PIECE + 1] = [1, 2.5]
    assert bad(CompletionRequest, {"prompt": nested})[0]["loc"] == ("body", "prompt", PIECE + 1, 1)
    bias = {str(i): 1.0 for i in range(LONG)}
    bias["77"] = float("nan")
    assert bad(CompletionRequest, {"prompt": "hi", "logit_bias": bias})[0]["loc"] == ("body", "logit_bias", "77")
    parts = [{"type": "text", "text": "a"}] * LONG
    parts[LONG - 1] = {"type": 5}
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": parts}]}
    assert bad(ChatCompletionRequest, chat)[0]["loc"] == ("body", "messages", 1, "content", LONG - 1, "type")
    # Every item bad: the first piece's first errors, not one error per item.
    assert len(bad(CompletionRequest, {"prompt": [0] + ["x"] * (100 * PIECE)})) == PIECE_ERRORS


def _unrested(value) -> int:
    """The counter's reference, from the parsed value: string values, arrays and literals."""
    if isinstance(value, dict):
        return sum(_unrested(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_unrested(v) for v in value)
    return isinstance(value, str) or value is None or isinstance(value, bool)


def test_the_counter_counts_strings_arrays_and_literals_as_parsed():
    rng = random.Random(7)
    pieces = ["t", "f", "n", "true", "null", ",", "[", "{", ":", '"', "\\", "\\\\", '\\"', "\\n", "é", " ", "x"]

    def value(depth: int):
        kind = rng.randrange(8 if depth < 4 else 5)
        if kind == 0:
            return "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))
        if kind == 1:
            return rng.choice([True, False, None])
        if kind == 2:
            return rng.choice([0, -7, 1.5e-3, 12345])
        if kind in (3, 4):
            return "".join(rng.choice("tfn") for _ in range(rng.randrange(4)))  # (a string of the literals' letters)
        if kind in (5, 6):
            return [value(depth + 1) for _ in range(rng.randrange(5))]
        return {"".join(rng.choice(pieces) for _ in range(3)): value(depth + 1) for _ in range(rng.randrange(5))}

    for _ in range(400):
        data = value(0)
        body = json.dumps(data, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
        size = rng.choice([1, 2, 3, 5, 64, len(body) or 1])
        raw = body.encode()
        counter = JSONValueCounter()
        for i in range(0, len(raw), size):
            counter.feed(raw[i : i + size])
        assert counter.unrested == _unrested(json.loads(body)), (body, size)


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=128, num_gpu_blocks=64, max_num_seqs=2)


def test_large_bodies_answer_as_small_ones_and_name_the_bad_item(app_state):
    """Through the server: a large body (the JSON thread, in pieces) gives the same 200 as the
    same request small; a bad id deep in a long prompt is a 400 naming prompt and its index;
    a body of half a million literals is refused before parsing, naming the setting."""
    state, app = app_state()
    vocab = state.info.vocab_size
    ids = [i % vocab for i in range(40_000)]  # (~230 KB: the JSON thread; kept to its last 8 ids)
    big = {"prompt": ids, "truncate_prompt_tokens": 8, "max_tokens": 3, "temperature": 0}
    small = {"prompt": ids[-8:], "max_tokens": 3, "temperature": 0}
    bad_ids = [*ids[:30_001], vocab + 5, *ids[30_002:]]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as http:
            answers = [await http.post("/v1/completions", json=b) for b in (big, small)]
            answers.append(await http.post("/v1/completions", json={**big, "prompt": [*ids[:30_000], "x", *ids]}))
            answers.append(await http.post("/v1/completions", json={**big, "prompt": bad_ids}))
            literals = b'{"prompt": "hi", "x": [' + b"true," * 500_000 + b"null]}"
            answers.append(
                await http.post("/v1/completions", content=literals, headers={"content-type": "application/json"})
            )
            return answers

    big_ok, small_ok, not_int, out_of_vocab, literals = asyncio.run(main())
    assert big_ok.status_code == 200 and small_ok.status_code == 200, (big_ok.text, small_ok.text)
    assert big_ok.json()["choices"][0]["text"] == small_ok.json()["choices"][0]["text"]
    err = not_int.json()["error"]
    assert not_int.status_code == 400 and err["param"] == "prompt.30000", err
    err = out_of_vocab.json()["error"]
    assert out_of_vocab.status_code == 400 and err["param"] == "prompt" and str(vocab + 5) in err["message"], err
    err = literals.json()["error"]
    assert literals.status_code == 400 and "max_request_json_strings=" in err["message"], err
    assert "literals" in err["message"], err
