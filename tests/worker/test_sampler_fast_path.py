"""The sampler's all-greedy path: argmax semantics (first maximum, -1 for non-finite rows) in one
numpy argmax on the CPU (three torch ops elsewhere), no per-row tensor work, no copy of the fresh
token tensor; mixed batches still sample."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.core.params import SamplingParams
from engine.worker.sample.sampler import Sampler, SampleRow


class _CountOps(TorchFunctionMode):
    """Counts torch calls (functions and tensor methods) by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def _rows(n: int, **params) -> list[SampleRow]:
    return [SampleRow(SamplingParams(max_tokens=8, **params), list(range(5)), 5, 0, key=i) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_is_one_argmax(dtype):
    logits = torch.randn(64, 512)
    logits[3] = float("nan")
    logits[5] = -float("inf")
    logits[7, 9] = float("inf")
    logits[8, 10] = logits[8, 20] = 100.0  # a tie: the first index wins, as argmax's
    logits[9, 30] = float("nan")  # NaN among finite values: no meaningful token either
    logits = logits.to(dtype)
    sampler = Sampler(torch.device("cpu"), (2,))
    counter = _CountOps()
    with counter:
        pending = sampler.launch(logits, _rows(64, temperature=0.0))
    compute = {op: n for op, n in counter.ops.items() if not op.startswith("__") and op not in ("device", "dtype")}
    # float32 on the CPU: numpy's argmax over the logits' own memory; otherwise three torch ops
    assert compute == ({"numpy": 1} if dtype == torch.float32 else {"max": 1, "isfinite": 1, "where": 1}), compute
    out = pending.result()
    assert pending.tokens.dtype == torch.int64
    want = logits.argmax(dim=-1).tolist()
    for i in (3, 5, 7, 9):
        want[i] = -1
    assert out.token_ids == want and want[8] == 10
    assert set(out.errors) == {3, 5, 7, 9}


def test_mixed_batch_keeps_sampling_and_greedy_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    rows = _rows(3, temperature=0.0) + _rows(3, temperature=1.0, seed=7)
    out = Sampler(torch.device("cpu"), (2,))(logits, rows)
    assert out.token_ids[:3] == logits[:3].argmax(dim=-1).tolist()
    again = Sampler(torch.device("cpu"), (2,))(logits, rows)
    assert out.token_ids[3:] == again.token_ids[3:]  # seeded rows repeat
    assert all(0 <= t < 50 for t in out.token_ids) and not out.errors
