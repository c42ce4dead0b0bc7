"""Per-token cost of stop-string checking, with many stop strings against one, at n samples.

    python tools/bench_stop_strings.py [--strings 1024] [--n 32] [--tokens 256]

Feeds n samples' text token by token through the output side's matcher (engine/runtime/
stop_strings.py: one automaton per request, each sample its own place in it), as the output
processor does after each detokenised token, with `--strings` stop strings that never match and
with one; prints µs per token per sample for both and their ratio (the bar: at most 2x), and the
same for the plain search every string (str.find per string) that the matcher replaced.
"""

from __future__ import annotations

import argparse
import random
import time

from engine.runtime.stop_strings import SampleStops, StopMatcher


def _texts(n: int, tokens: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    words = ["the", " model", " said", ",", " and", " then", " 42", " tokens", ".", "\n", " é", " 東京"]
    return [[rng.choice(words) for _ in range(tokens)] for _ in range(n)]


def _stops(count: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    # Realistic-looking strings that do not occur in the texts (the worst case: every check runs to the end).
    return [f"<|stop-{rng.randrange(10**9)}|>" for _ in range(count)]


def matcher_cost(texts: list[list[str]], stops: list[str]) -> float:
    """Seconds per token per sample through StopMatcher."""
    matcher = StopMatcher(stops)
    samples = [SampleStops(matcher) for _ in texts]
    t0 = time.perf_counter()
    for sample, pieces in zip(samples, texts):
        text = ""
        for piece in pieces:
            before = len(text)
            text += piece
            assert sample.find(text, before) is None
    return (time.perf_counter() - t0) / sum(len(p) for p in texts)


def search_cost(texts: list[list[str]], stops: list[str]) -> float:
    """Seconds per token per sample searching the text for every string (the old rule)."""
    longest = max(len(s) for s in stops)
    t0 = time.perf_counter()
    for pieces in texts:
        text = ""
        for piece in pieces:
            start = max(0, len(text) - longest + 1)
            text += piece
            assert all(text.find(s, start) == -1 for s in stops)
    return (time.perf_counter() - t0) / sum(len(p) for p in texts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strings", type=int, default=1024, help="stop strings of the many-strings case (default 1024)")
    p.add_argument("--n", type=int, default=32, help="samples of the request (default 32)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample (default 256)")
    p.add_argument("--rounds", type=int, default=5, help="best of this many rounds (default 5)")
    args = p.parse_args(argv)
    texts = _texts(args.n, args.tokens)
    many, one = _stops(args.strings), _stops(1)
    t0 = time.perf_counter()
    StopMatcher(many)
    build_ms = (time.perf_counter() - t0) * 1e3
    best = {
        k: min(f(texts, s) for _ in range(args.rounds))
        for k, f, s in (
            ("matcher 1", matcher_cost, one),
            (f"matcher {args.strings}", matcher_cost, many),
            ("search 1", search_cost, one),
        )
    }
    best[f"search {args.strings}"] = min(search_cost(texts, many) for _ in range(max(1, args.rounds // 5)))
    print(f"n={args.n}, {args.tokens} tokens a sample; building the {args.strings}-string automaton: {build_ms:.1f} ms")
    for name, seconds in best.items():
        print(f"  {name:>16} strings: {seconds * 1e6:8.2f} us / token / sample")
    ratio = best[f"matcher {args.strings}"] / best["matcher 1"]
    print(
        f"matcher, {args.strings} strings vs 1: {ratio:.2f}x (bar: <= 2x); "
        f"search every string, {args.strings} vs 1: {best[f'search {args.strings}'] / best['search 1']:.0f}x"
    )
    return 0 if ratio <= 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
