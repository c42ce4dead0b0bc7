"""Stop strings at the cost of one matcher: an Aho–Corasick automaton built once per request
(shared by its n samples), fed each sample's new characters once.

Checking a token's new text costs the characters it added (plus the matches that end in them),
not the number of stop strings: a request with hundreds of stop strings checks a token in about
the time one string takes (`tools/bench_stop_strings.py` prints both). What is reported is what
searching the text for every string would find: among the occurrences that end in the new text,
the one that starts first (on a tie, the one listed first in `stop`).
"""

from __future__ import annotations


class StopMatcher:
    """The automaton over one request's stop strings (immutable once built: shared by samples)."""

    __slots__ = ("stops", "max_len", "_goto", "_fail", "_out")

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        goto: list[dict[str, int]] = [{}]
        out: list[list[int]] = [[]]  # node -> the stops (by index) that end there, longest first
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    out.append([])
                node = nxt
            if not out[node]:  # (a repeated string keeps its first place)
                out[node].append(index)
        fail = [0] * len(goto)
        order = list(goto[0].values())  # breadth first: a node's failure link is shorter, so done first
        for node in order:
            for ch, child in goto[node].items():
                order.append(child)
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0)
                fail[child] = target if target != child else 0
                out[child] = out[child] + out[fail[child]]  # the stops ending here by a suffix too
        self._goto, self._fail, self._out = goto, fail, out

    def scan(self, text: str, start: int, node: int) -> tuple[tuple[int, str] | None, int]:
        """Feed text[start:] from automaton state `node`: (the first-starting stop occurrence ending
        in it as (where it starts, which stop), or None; the state after the text)."""
        goto, fail, out, stops = self._goto, self._fail, self._out, self.stops
        best: tuple[int, int] | None = None  # (start, stop index)
        for pos in range(start, len(text)):
            ch = text[pos]
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            for index in out[node]:
                at = pos + 1 - len(stops[index])
                if best is None or (at, index) < best:
                    best = (at, index)
        return (None if best is None else (best[0], stops[best[1]])), node


class SampleStops:
    """One sample's place in its request's matcher: the automaton state after the text fed so far."""

    __slots__ = ("matcher", "node", "fed")

    def __init__(self, matcher: StopMatcher) -> None:
        self.matcher = matcher
        self.node = 0
        self.fed = -1  # characters of the text fed so far (-1: none yet / out of step: start afresh)

    def find(self, text: str, before: int) -> tuple[int, str] | None:
        """The first-starting stop string in `text` whose occurrence ends past `before` (the text's
        length at the last check) or starts within the longest stop's reach of it."""
        window = max(0, before - self.matcher.max_len + 1)
        if self.fed < window or self.fed > len(text):  # (checks were skipped: min_tokens) start afresh
            self.node, self.fed = 0, window
        hit, self.node = self.matcher.scan(text, self.fed, self.node)
        self.fed = len(text)
        return hit

    def skip(self) -> None:
        """A token whose text is not checked (min_tokens not reached): the next check starts afresh."""
        self.fed = -1
