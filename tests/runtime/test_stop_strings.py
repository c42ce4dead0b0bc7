"""The stop-string matcher agrees with searching the text for every string, token by token, on
random texts and string sets (hypothesis), and handles the cases that trip automata."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.stop_strings import SampleStops, StopMatcher


def brute_force(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The rule as it was written before the matcher: the earliest start of any stop at or after `start`."""
    best = None
    for stop in stops:
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def check_stream(pieces: list[str], stops: list[str], skip_first: int = 0):
    """Feed `pieces` as a sample's new text per token; returns the matcher's and the brute force's
    first hit (token index, hit)."""
    matcher = StopMatcher(stops)
    sample = SampleStops(matcher)
    longest = max(len(s) for s in stops)
    text = ""
    got = want = None
    for i, piece in enumerate(pieces):
        before = len(text)
        text += piece
        if not piece:
            continue
        if i < skip_first:  # min_tokens not reached: not checked
            sample.skip()
            continue
        if got is None:
            hit = sample.find(text, before)
            got = (i, hit) if hit else None
        if want is None:
            hit = brute_force(text, stops, max(0, before - longest + 1))
            want = (i, hit) if hit else None
        if got or want:
            break
    return got, want


alphabet = st.sampled_from("abc")


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    pieces=st.lists(st.text(alphabet, max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=6),
    skip_first=st.integers(0, 3),
)
def test_matcher_agrees_with_searching_every_string(pieces, stops, skip_first):
    got, want = check_stream(pieces, stops, skip_first)
    assert got == want


def test_overlapping_and_nested_strings():
    # "bc" ends first but "abcd" starts first once both are in the text of one token.
    assert check_stream(["abcd"], ["bc", "abcd"])[0] == (0, (0, "abcd"))
    # Across tokens the shorter one completes first and wins, as the plain search had it.
    assert check_stream(["ab", "c", "d"], ["abcd", "bc"])[0] == (1, (1, "bc"))
    # A string that is a suffix of another is found through the failure links.
    assert check_stream(["xxab"], ["zab", "ab"])[0] == (0, (2, "ab"))
    # Same start: the one listed first.
    assert check_stream(["abc"], ["abc", "ab"])[0] == (0, (0, "abc"))
    assert check_stream(["abc"], ["ab", "abc"])[0] == (0, (0, "ab"))
    assert StopMatcher(["ab", "ab"]).scan("xab", 0, 0)[0] == (1, "ab")


def test_many_strings_share_one_automaton():
    stops = [f"<stop {i}>" for i in range(2000)]
    matcher = StopMatcher(stops)
    samples = [SampleStops(matcher) for _ in range(4)]
    text = "plain words " * 5 + "<stop 1999>"
    assert all(s.find(text, 0) == (60, "<stop 1999>") for s in samples)
    assert matcher.max_len == len("<stop 1999>")


def test_the_benchmark_runs(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import bench_stop_strings

    bench_stop_strings.main(["--strings", "64", "--n", "2", "--tokens", "16", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "matcher, 64 strings vs 1:" in out and "search every string" in out
