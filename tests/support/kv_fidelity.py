"""Prompts and the token-agreement measure shared by the reduced-precision KV tests (fp8, float16)."""

from __future__ import annotations

FIDELITY_PROMPTS = [
    "The quick brown fox",
    "A kiln is a thermally insulated",
    "Kilns have been used for",
    "Large language models generate",
    "Paged attention stores the keys",
    "Continuous batching lets new",
    "Hello, world! How are",
    "Numbers: 0 1 2 3",
    "The user asked a question and",
    "What is the capital of",
    "Yesterday I learnt that a kiln is a",
    "Grandma said: the quick brown",
    "For the exam: paged attention stores",
    "Breaking news! Continuous batching lets",
    "My notes say large language models",
    "Ok so, hello, world! How",
    "In short, kilns have been used",
    "Dear sir, the user asked a",
    "Read this: numbers: 0 1 2",
    "Quiz time. What is the capital",
]


def token_agreement(a, b):
    pairs = [(x, y) for oa, ob in zip(a, b) for x, y in zip(oa.outputs[0].token_ids, ob.outputs[0].token_ids)]
    return sum(x == y for x, y in pairs) / len(pairs)
