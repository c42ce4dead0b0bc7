"""The scheduler under swap: a fake model's tokens and the outputs they must give."""

from __future__ import annotations


def fake_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


def expected_outputs(prompt: list[int], max_tokens: int, n: int) -> list[list[int]]:
    outs = []
    for k in range(n):
        toks = list(prompt)
        first = fake_token(toks)
        toks.append((first + k) % 100 if n > 1 else first)
        while len(toks) - len(prompt) < max_tokens:
            toks.append(fake_token(toks))
        outs.append(toks[len(prompt) :])
    return outs


def prompt(base: int, length: int) -> list[int]:
    return [(base * 7 + i) % 50 + 1 for i in range(length)]
