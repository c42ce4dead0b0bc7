"""The step's prefill allowance under an inter-token latency target (the target_itl_ms setting).

Every decoding sequence waits for the whole step, so a prefill chunk that rides along with
decodes stretches their inter-token gap by its own cost. With a target, the scheduler asks here
how many prefill tokens fit beside the step's decodes:

    allowance = (target - decode_ms(decodes)) / ms_per_prefill_token

from an online cost model (`StepCostModel`) that learns from each step's measured model time
(EngineCore feeds it): a least-squares line ms ~ base + a * decodes + b * prefill tokens over the
last WINDOW decode-only steps and the last WINDOW steps with prefill (two windows, so that a long
run of decodes does not forget the prefill rate; a fit over both separates the decodes' share of
a mixed step from its prefill's, which per-kind averages cannot when every step is mixed). The
allowance is rounded down to whole KV blocks (few step shapes) and never below one block (a
prompt always progresses); a step with no decodes has no gap to protect and keeps the full token
budget (the first token of an idle server is not slowed).
Until the model has seen a prefill, the full budget stands: the first prefill teaches it.
Pure Python, no clock of its own: the caller passes measured milliseconds.
The step's other prefill limits are here too: one prompt's share (`chunk_cap`) and the tokens held
back from running prompts for waiting ones that fit whole (`whole_prompts_reserve`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.core.request import Sequence
    from engine.core.sched.scheduler_config import SchedulerConfig

# Steps of each kind (decode-only, with prefill) the fit remembers.
WINDOW = 32
# Keeps the fit solvable before both kinds were seen (tiny next to the counts' squares).
RIDGE = 1e-3


def _solve3(a: list[list[float]], y: list[float]) -> list[float]:
    """a x = y for a 3x3 system (Gaussian elimination with partial pivoting)."""
    m = [row[:] + [v] for row, v in zip(a, y)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x


class StepCostModel:
    """ms of a step's model time ~ base + per_decode * decodes + per_prefill_token * prefill tokens."""

    def __init__(self) -> None:
        self._decodes: deque[tuple[float, float, float]] = deque()  # (decodes, 0, ms) of decode-only steps
        self._prefills: deque[tuple[float, float, float]] = deque()  # (decodes, prefill, ms) of the others
        # The normal equations' sums over both windows, kept as rows come and go (no pass per step).
        self._xtx = [[RIDGE if i == j else 0.0 for j in range(3)] for i in range(3)]
        self._xty = [0.0, 0.0, 0.0]
        self._theta: list[float] | None = None  # (base, per decode, per prefill token), fitted lazily

    def observe(self, prefill_tokens: int, decode_seqs: int, model_ms: float) -> None:
        """Take in one step's measured model time."""
        if model_ms <= 0 or prefill_tokens + decode_seqs == 0:
            return
        window = self._prefills if prefill_tokens else self._decodes
        row = (float(decode_seqs), float(prefill_tokens), model_ms)
        window.append(row)
        self._account(row, 1.0)
        if len(window) > WINDOW:
            self._account(window.popleft(), -1.0)
        self._theta = None

    def _account(self, row: tuple[float, float, float], sign: float) -> None:
        d, p, ms = row
        x = (1.0, d, p)
        for i in range(3):
            self._xty[i] += sign * x[i] * ms
            for j in range(3):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _fit(self) -> list[float]:
        if self._theta is None:
            self._theta = _solve3(self._xtx, self._xty)
        return self._theta

    @property
    def ms_per_prefill_token(self) -> float | None:
        """None until a step with prefill was seen; never below a microsecond (a noisy fit)."""
        if not self._prefills:
            return None
        return max(self._fit()[2], 1e-3)

    def decode_ms(self, seqs: int) -> float:
        """Predicted model time of a step of `seqs` decodes and no prefill (0 before any step)."""
        if seqs <= 0 or not (self._decodes or self._prefills):
            return 0.0
        base, per_decode, _ = self._fit()
        return max(base + per_decode * seqs, 0.0)


class StepBudget:
    """Prefill tokens a step may carry beside its decodes so that it stays within target_ms."""

    def __init__(self, target_ms: float, max_tokens: int, block_size: int) -> None:
        if target_ms <= 0:
            raise ValueError(f"target_itl_ms must be positive, got {target_ms}")
        self.target_ms = target_ms
        self.max_tokens = max_tokens  # max_num_batched_tokens: the hard cap stays
        self.block_size = block_size
        self.cost = StepCostModel()

    @classmethod
    def of(cls, config: "SchedulerConfig") -> "StepBudget | None":
        """The scheduler's budget: None without a target, or without chunked prefill (nothing to cut)."""
        if not config.target_itl_ms or not config.enable_chunked_prefill:
            return None
        return cls(config.target_itl_ms, config.max_num_batched_tokens, config.block_size)

    def observe(self, prefill_tokens: int, decode_seqs: int, model_ms: float) -> None:
        self.cost.observe(prefill_tokens, decode_seqs, model_ms)

    def allowance(self, running: "list[Sequence]") -> int:
        """The prefill allowance of a step over these running sequences: those with one token to run
        (not paused) are its decodes."""
        return self.prefill_tokens(num_decodes(running))

    def prefill_tokens(self, decode_seqs: int) -> int:
        """The step's prefill allowance next to `decode_seqs` decodes (see the module docstring)."""
        full = self.max_tokens - decode_seqs
        rate = self.cost.ms_per_prefill_token
        if decode_seqs == 0 or rate is None or rate <= 0:
            return full
        spare_ms = self.target_ms - self.cost.decode_ms(decode_seqs)
        tokens = int(spare_ms / rate) // self.block_size * self.block_size
        allowance = min(max(tokens, self.block_size), full)
        return max(allowance, 1)


def num_decodes(running: "list[Sequence]") -> int:
    """Running sequences with one token to run (not paused): the step's decodes."""
    return sum(1 for s in running if len(s.token_ids) - s.num_computed_tokens == 1 and not s.request.paused)


def chunk_cap(config: "SchedulerConfig") -> int:
    """One prompt's tokens in a step at most (long_prefill_token_threshold, with chunked prefill):
    short prompts queued behind a long one start in the same step instead of after it."""
    if config.enable_chunked_prefill and config.long_prefill_token_threshold > 0:
        return config.long_prefill_token_threshold
    return config.max_num_batched_tokens


def whole_prompts_reserve(
    running: "list[Sequence]",
    waiting: "list[Sequence]",
    seats_left: int,
    allowance: int,
    seats: "Callable[[Sequence], int]",
) -> int:
    """Prefill tokens a step holds back from running prompts' next pieces for waiting prompts that fit
    whole (the whole_prompts_first setting): without it a long prompt's pieces take each step's budget
    first and a short prompt queued behind it waits for its whole prefill (on 2 CPU cores, minutes).
    Counted from the head of `waiting` (priority, then arrival: nothing jumps the queue within it),
    only prompts at least as urgent as every running prompt, as many as the free seats take, and at
    most half the allowance, so that a running prompt keeps at least the other half of every step."""
    urgency = None
    for s in running:
        if len(s.token_ids) - s.num_computed_tokens > 1 and not s.request.paused:
            p = s.request.priority
            urgency = p if urgency is None or p < urgency else urgency
    if urgency is None:
        return 0  # no running prompt to hold back
    cap = allowance // 2
    held = 0
    for s in waiting:
        if s.request.paused:
            continue  # (skipped by admission too)
        need = s.num_tokens - s.num_computed_tokens
        if s.request.priority > urgency or held + need > cap or seats(s) > seats_left:
            break
        held += need
        seats_left -= seats(s)
    return held


class MicroSteps:
    """A CPU step's rows kept within what its fastest kernels take (the cpu_micro_batch_tokens
    setting), as llama.cpp splits a batch into micro-batches: a step of more rows runs the quantised
    layers as a GEMM on a dequantised float32 weight, at 1.6-3x the per-token cost of the
    weight-streaming kernels below that (docs/benchmarks.md, first token under load). Where the
    decodes plus the prompts to run exceed `tokens`, the step becomes prefill-only pieces of at most
    `tokens` that stop one token short of each prompt's end (no decode, nothing sampled: `hold`);
    the decodes and the prompts' last tokens run together once the pieces are done, or once
    `max_tokens` of prefill (one ordinary step's budget) ran since the decodes last did, so that a
    decoding sequence waits for no more prefill than one ordinary step would make it wait for."""

    def __init__(self, tokens: int, max_tokens: int) -> None:
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.held_prefill = 0  # prefill tokens run in held steps since the decodes last ran

    def plan(self, running: "list[Sequence]", waiting: "list[Sequence]", seats_left: int) -> tuple[bool, int]:
        """(hold the decodes?, the step's prefill allowance) for a step over these queues."""
        decodes = num_decodes(running)
        if not decodes:
            return False, self.tokens  # (nothing to hold: prompts run in steps of `tokens`)
        work = sum(n - 1 for s in running if (n := len(s.token_ids) - s.num_computed_tokens) > 1)
        for s in waiting:
            if seats_left <= 0:
                break
            if not s.request.paused:
                work += s.num_tokens - s.num_computed_tokens - 1
                seats_left -= 1
        hold = decodes + work > self.tokens and self.held_prefill + self.tokens <= self.max_tokens
        return hold, self.tokens if hold else max(self.tokens - decodes, 0)

    def ran(self, held: bool, prefill_tokens: int) -> None:
        self.held_prefill = self.held_prefill + prefill_tokens if held else 0


class PrefillWave:
    """Prompts that arrive together have their first tokens together (the cpu_prefill_wave_tokens
    setting), as llama.cpp's batch of micro-batches (-b 2048 over -ub 512) does: where the prompts in
    flight need more rows than a step leaves beside its decodes, their pieces stop one token short of
    each prompt's end (nothing sampled for them) until what is left of them fits one step. Without it
    the prompts done in the first step start decoding and then wait a whole step (~2 s for a 1.2B
    model on 2 cores) for the others' prefill: on a c16 wave of 64-token prompts that gap is the ITL
    p99 (docs/benchmarks.md, latency under load). Decodes run in every step as before, so none waits
    longer than it did; steps keep their rows (memory, kernels). The wave is the running prompts,
    then the waiting ones (the order steps take them in), as far as their rows plus those already run
    in held steps stay within `wave_tokens`: a prompt's first token waits for at most that much
    prefill, and a long prompt that does not fit leaves the steps as they were."""

    def __init__(self, step_tokens: int, wave_tokens: int) -> None:
        self.step_tokens = step_tokens
        self.wave_tokens = wave_tokens
        self.held_prefill = 0  # prefill rows run in held steps since the wave's first tokens last came

    def plan(self, running: "list[Sequence]", waiting: "list[Sequence]", seats_left: int) -> bool:
        """Whether this step holds its prompts' last tokens."""
        decodes = 0
        rows = 0  # the wave's rows still to run
        cap = self.wave_tokens - self.held_prefill
        full = False  # a prompt beyond the wave: the ones after it are not in it either
        for s in running:
            n = len(s.token_ids) - s.num_computed_tokens
            if n <= 0 or s.request.paused:
                continue
            if n == 1 and s.num_computed_tokens >= s.num_prompt_tokens:
                decodes += 1
            elif not full and rows + n <= cap:
                rows += n
            else:
                full = True
        for s in waiting:
            if full or seats_left <= 0:
                break
            if s.request.paused:
                continue
            n = s.num_tokens - s.num_computed_tokens
            if rows + n > cap:
                break
            rows += n
            seats_left -= 1
        return rows > self.step_tokens - decodes

    def ran(self, held: bool, prefill_tokens: int) -> None:
        self.held_prefill = self.held_prefill + prefill_tokens if held else 0
