"""Overlap scheduling's workload and its summary, shared by its feature tests."""

from __future__ import annotations

PROMPTS = [
    list(range(10, 30)),
    list(range(10, 30)) + [7, 8, 9],
    [5, 9, 100, 200, 7],
    list(range(60, 100)),
    [300, 301],
    list(range(10, 26)),
    [44] * 12,
    list(range(200, 240)),
]


class _Close(float):
    """A logprob, equal to another within 1e-4: the overlapped loop's batches may hold a row more
    (a finished sequence's discarded token), so the model's matmuls may round a little differently;
    the tokens must match exactly."""

    def __eq__(self, other):
        return abs(float(self) - float(other)) <= 1e-4

    def __ne__(self, other):
        return not self == other

    __hash__ = float.__hash__


def _summary(outs):
    return [
        [
            (
                c.index,
                tuple(c.token_ids),
                c.text,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [sorted((t, _Close(v)) for t, v in e.items()) for e in c.logprobs],
            )
            for c in o.outputs
        ]
        for o in outs
    ]
