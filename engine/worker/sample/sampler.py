"""Token sampling on the device: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One batched pass over all rows; the only host transfer is the final copy of the chosen
tokens (and their logprobs when asked for). Random rows use the exponential-race trick
(argmax of p / E with E ~ Exp(1)), which needs no sorting or cumsum over the vocabulary.
A row with a seed draws its noise from a generator seeded by (seed, sample index,
output position): its tokens depend on nothing else in the batch.

Overlap scheduling: a row's history may end in a PLACEHOLDER, the token the previous launched
step sampled that the host has not seen yet. Penalty counts take it from that step's device
tensor (`LastSampled`), so a step with penalties is launched before the previous one is processed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.outputs import SamplerOutput
from engine.core.params import SamplingParams
from engine.core.sched.scheduler_output import PLACEHOLDER
from engine.spec_decode.rejection import DraftProbs, rejection_tokens
from engine.structured_output.grammars import bitmask_words, unpack_bitmask
from engine.structured_output.step_bitmask import StepBitmask
from engine.worker.host_upload import upload
from engine.worker.sample.distributions import processed_probs, race_noise
from engine.worker.sample.logprobs import pack_chosen_and_top
from engine.worker.sample.sampler_output import HostCopy, LastSampled, PendingSample


@dataclass
class SampleRow:
    params: SamplingParams
    all_token_ids: list[int]
    num_prompt_tokens: int
    sample_index: int
    # Structured outputs: a grammar constrains the row (the core fills its bitmask row).
    constrained: bool = False
    # Speculative decoding: the drafts before this row's position, after all_token_ids (kept
    # apart so that a row does not copy a long sequence; joined only where history is read).
    extra: list[int] = field(default_factory=list)
    key: int | None = None  # the sequence's id: penalty state is kept per sequence across steps
    # Greedy with nothing else to apply, for good (a decoding sequence's row is reused step after
    # step, and its output only grows past min_tokens): a batch of such rows is one argmax, with no
    # per-feature pass over the rows (and a decode graph's own argmax serves it: engine/worker/model_runner.py).
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (
            p.greedy
            and not p.logits_processors
            and not p.restricts_tokens
            and not self.constrained
            and (p.min_tokens == 0 or self.num_output_tokens >= p.min_tokens)
            and not p.needs_penalties
            and p.logprobs is None
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) + len(self.extra) - self.num_prompt_tokens

    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :] + self.extra


class _BatchNeeds:
    """What a batch's sampling needs beyond argmax, from one pass over its rows."""

    __slots__ = ("processors", "restricts", "grammar", "min_tokens", "penalties", "logprobs", "greedy", "all_greedy")

    def __init__(self, rows: list[SampleRow]) -> None:
        processors = restricts = grammar = min_tokens = penalties = logprobs = False
        greedy = []
        for r in rows:
            p = r.params
            processors = processors or bool(p.logits_processors)
            restricts = restricts or p.restricts_tokens
            grammar = grammar or r.constrained
            min_tokens = min_tokens or (p.min_tokens > 0 and r.num_output_tokens < p.min_tokens)
            penalties = penalties or p.needs_penalties
            logprobs = logprobs or p.logprobs is not None
            greedy.append(p.greedy)
        self.processors, self.restricts, self.grammar = processors, restricts, grammar
        self.min_tokens, self.penalties, self.logprobs = min_tokens, penalties, logprobs
        self.greedy, self.all_greedy = greedy, all(greedy)


def _greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax per row (the first maximum), -1 where the row's maximum is NaN, +inf or -inf (no
    meaningful token). On the CPU numpy's argmax: torch's reduction over a short last dimension
    costs ~25 µs per 64x512 call, numpy's ~3 (same first-maximum rule, NaN counted as the maximum)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        host = logits.numpy()
        tokens = host.argmax(axis=1)
        top = host[np.arange(len(tokens)), tokens]
        tokens[~np.isfinite(top)] = -1
        return torch.from_numpy(tokens.astype(np.int64, copy=False))
    top, tokens = logits.max(dim=-1)
    return torch.where(torch.isfinite(top), tokens, -1)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._penalty_states: dict[int, _PenaltyState] = {}  # by sequence id, kept from the last step

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """logits: float32 [len(rows), vocab]."""
        return self.launch(logits, rows).result()

    def launch(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        last: "LastSampled | None" = None,
        drafts: DraftProbs | None = None,
        bitmask: StepBitmask | None = None,
    ) -> "PendingSample":
        """Sample on the device; the tokens stay there (PendingSample.tokens) and are copied to
        the host without blocking: result() waits for that copy only. `last`: the previous
        launched step's tokens, for rows whose history ends in its PLACEHOLDER. `drafts`: rows
        that verify a draft model's sampled drafts with its q (engine/spec_decode/rejection.py).
        `bitmask`: the constrained rows' allowed tokens, as the core's matchers filled them."""
        if not rows:
            return PendingSample.empty(self.device)
        if all([r.plain for r in rows]):
            tokens = _greedy_tokens(logits)
            return PendingSample(tokens, HostCopy(tokens, owned=True), {})
        needs = _BatchNeeds(rows)
        errors: dict[int, str] = {}
        if needs.processors:
            logits = self._apply_processors(logits, rows, errors)
        raw_logits = logits
        if needs.restricts:
            logits = self._apply_bias(logits, rows)
        grammar_mask, must_stop = (
            self._grammar_bitmask(rows, logits.shape[1], errors, bitmask) if needs.grammar else (None, set())
        )
        if needs.min_tokens:
            logits = self._apply_min_tokens(logits, rows, must_stop)
        if needs.penalties:
            logits = self._apply_penalties(logits, rows, last)
        if grammar_mask is not None:
            logits = self._apply_grammar(logits, rows, grammar_mask)
        if needs.all_greedy:  # the common case: one reduction gives the token and its logit
            tokens = _greedy_tokens(logits)
        else:
            tokens = self._sample_random(logits, rows, needs.greedy, drafts)
            # A row whose logits are NaN, +inf or all -inf has no meaningful token: -1 marks it, in
            # the same device-to-host copy as the tokens (no extra sync).
            tokens = torch.where(torch.isfinite(logits.amax(dim=-1)), tokens, -1)
        if not needs.logprobs:
            return PendingSample(tokens, HostCopy(tokens, owned=True), errors)
        want_logprobs = [r.params.logprobs for r in rows]
        top_n = max(n or 0 for n in want_logprobs)
        return PendingSample(
            tokens, HostCopy(pack_chosen_and_top(raw_logits, tokens, top_n), owned=True), errors, want_logprobs, top_n
        )

    def _apply_processors(self, logits: torch.Tensor, rows: list[SampleRow], errors: dict[int, str]) -> torch.Tensor:
        """Run each row's logits processors on that row; an exception fails only that row."""
        logits = logits.clone()
        for i, r in enumerate(rows):
            if not r.params.logits_processors:
                continue
            row = logits[i]
            try:
                out_ids = r.output_token_ids()
                for proc in r.params.logits_processors:
                    row = proc(out_ids, row)
                    if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                        raise TypeError(
                            f"a logits processor returned {type(row).__name__} "
                            f"{getattr(row, 'shape', '')}, expected a tensor of shape "
                            f"{tuple(logits[i].shape)}"
                        )
                logits[i] = row
            except Exception as exc:  # noqa: BLE001 - user code: isolate it to its request
                errors[i] = f"logits processor failed: {type(exc).__name__}: {exc}"
        return logits

    def _apply_bias(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logit_bias added, then everything outside allowed_token_ids set to -inf."""
        logits = logits.clone()
        bias_rows, bias_ids, bias_vals = [], [], []
        allow_rows, allow_ids = [], []
        for i, r in enumerate(rows):
            for t, b in (r.params.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(t)
                bias_vals.append(b)
            for t in r.params.allowed_token_ids or ():
                allow_rows.append(i)
                allow_ids.append(t)
        if bias_rows:
            logits.index_put_(
                (upload(bias_rows, torch.int64, self.device), upload(bias_ids, torch.int64, self.device)),
                upload(bias_vals, logits.dtype, self.device),
                accumulate=True,
            )
        restricted = sorted({i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None})
        if restricted:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[upload(allow_rows, torch.int64, self.device), upload(allow_ids, torch.int64, self.device)] = True
            unrestricted = torch.ones(len(rows), dtype=torch.bool, device=self.device)
            unrestricted[upload(restricted, torch.int64, self.device)] = False
            logits = torch.where(keep | unrestricted[:, None], logits, -float("inf"))
        return logits

    def _grammar_bitmask(
        self, rows: list[SampleRow], vocab: int, errors: dict[int, str], bitmask: StepBitmask | None
    ) -> tuple[torch.Tensor | None, set[int]]:
        """The allowed-token bitmask of every row (the core's, all ones for rows without a
        grammar), and the rows whose grammar allows nothing but a stop token now. A row whose
        matcher failed fails alone."""
        if bitmask is None:
            raise RuntimeError("a constrained row is sampled without the core's grammar bitmask")
        mask = bitmask.mask
        if mask.shape != (len(rows), bitmask_words(vocab)):
            raise RuntimeError(f"grammar bitmask of shape {tuple(mask.shape)} for {len(rows)} rows of {vocab} tokens")
        must_stop: set[int] = set()
        for i, r in enumerate(rows):
            if not r.constrained:
                continue
            if i in bitmask.errors:
                errors[i] = bitmask.errors[i]
                continue
            if r.num_output_tokens < r.params.min_tokens:  # min_tokens would ban the only way out
                allowed = unpack_bitmask(mask[i : i + 1], vocab)[0]
                allowed[[t for t in (*self.eos_token_ids, *r.params.stop_token_ids) if t < vocab]] = False
                if not bool(allowed.any()):
                    must_stop.add(i)
        return mask, must_stop

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SampleRow], mask: torch.Tensor) -> torch.Tensor:
        """-inf where the rows' grammars forbid the token (only grammar rows are unpacked)."""
        constrained = [i for i, r in enumerate(rows) if r.constrained]
        if len(constrained) == len(rows):
            allowed = unpack_bitmask(mask.to(self.device, non_blocking=True), logits.shape[1])
            return logits.masked_fill(~allowed, -float("inf"))
        index = upload(constrained, torch.int64, self.device)
        allowed = unpack_bitmask(mask[constrained].to(self.device, non_blocking=True), logits.shape[1])
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, -float("inf"))
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SampleRow], must_stop: set[int]) -> torch.Tensor:
        """Ban stop tokens before min_tokens, except in rows whose grammar can only stop (it wins)."""
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, r in enumerate(rows):
            if r.num_output_tokens < r.params.min_tokens and i not in must_stop:
                for t in (*self.eos_token_ids, *r.params.stop_token_ids):
                    banned_rows.append(i)
                    banned_ids.append(t)
        if not banned_rows:
            return logits
        logits = logits.clone()
        index = (upload(banned_rows, torch.int64, self.device), upload(banned_ids, torch.int64, self.device))
        logits[index] = -float("inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow], last: "LastSampled | None") -> torch.Tensor:
        """Repetition / frequency / presence penalties, on the rows that ask for them. Each such
        sequence's output-token counts and prompt-token mask live on the device across steps
        and only its new tokens are added (a row's history is not re-sent every step);
        sequences absent from a step drop theirs. A new token still in flight (a PLACEHOLDER) is
        added from `last` on the device, all such rows in one op, and the row keeps the step's
        counts as its own from then on."""
        vocab = logits.shape[1]
        picked = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        rows_p = [rows[i] for i in picked]
        states: dict[int, _PenaltyState] = {}
        counts_rows, prompt_rows = [], []
        fed: list[tuple[int, int, _PenaltyState]] = []  # (row, seq id, state) whose last token is in flight
        for j, r in enumerate(rows_p):
            key = r.key if r.key is not None else id(r)
            state = states.get(key) or self._penalty_states.get(key)
            if state is None or state.counted > r.num_output_tokens - len(r.extra):
                state = _PenaltyState(r.all_token_ids[: r.num_prompt_tokens], vocab, self.device)
            states[key] = state
            counts, in_flight = state.counts_for(r)
            if in_flight:
                fed.append((j, key, state))
            counts_rows.append(counts)
            prompt_rows.append(state.in_prompt)
        self._penalty_states = states
        counts = torch.stack(counts_rows)
        if fed:
            if last is None:
                raise RuntimeError("a penalty row's last token is in flight but no launched step holds it")
            src = last.rows_of([key for _, key, _ in fed])
            index = upload([[j for j, _, _ in fed], src], torch.int64, self.device)
            # (-1, a failed row, counts as token 0: that request is failed and this step discarded)
            tokens = last.tokens.index_select(0, index[1]).clamp(min=0)
            counts.index_put_(
                (index[0], tokens), torch.ones(len(fed), dtype=counts.dtype, device=self.device), accumulate=True
            )
            for j, _, state in fed:
                state.counts = counts[j]  # (a view: later steps add to it in place)
        in_prompt = torch.stack(prompt_rows)
        rep = upload([r.params.repetition_penalty for r in rows_p], torch.float32, self.device)[:, None]
        freq = upload([r.params.frequency_penalty for r in rows_p], torch.float32, self.device)[:, None]
        pres = upload([r.params.presence_penalty for r in rows_p], torch.float32, self.device)[:, None]
        whole = len(picked) == len(rows)
        sub = logits if whole else logits[upload(picked, torch.int64, self.device)]
        seen = in_prompt | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).float()
        if whole:
            return sub
        logits = logits.clone()
        logits[upload(picked, torch.int64, self.device)] = sub
        return logits

    def _sample_random(
        self, logits: torch.Tensor, rows: list[SampleRow], greedy: list[bool], drafts: DraftProbs | None = None
    ) -> torch.Tensor:
        probs = processed_probs(logits, rows, greedy)
        sampled = (probs / race_noise(probs, rows, greedy, self.generator)).argmax(dim=-1)
        if any(greedy):
            g = upload(greedy, torch.bool, self.device)
            sampled = torch.where(g, logits.argmax(dim=-1), sampled)
        if drafts is not None and drafts.num_rows:
            # A model's sampled drafts: each row's token is its draft or the residual's sample
            # (engine/spec_decode/rejection.py); the rest of the row's sample is not used.
            sampled = sampled.index_put((drafts.rows,), rejection_tokens(probs[drafts.rows], drafts, self.generator))
        return sampled


class _PenaltyState:
    """One sequence's penalty inputs on the device: which tokens its prompt holds, and how often
    each token occurs in the first `counted` output tokens."""

    def __init__(self, prompt: list[int], vocab: int, device: torch.device) -> None:
        self.device = device
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        if prompt:
            self.in_prompt[upload(prompt, torch.int64, device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.counted = 0

    def _add(self, counts: torch.Tensor, tokens: list[int]) -> None:
        if tokens:
            ids = upload(tokens, torch.int64, self.device)
            counts.index_add_(0, ids, torch.ones(len(tokens), dtype=counts.dtype, device=self.device))

    def counts_for(self, r: SampleRow) -> tuple[torch.Tensor, bool]:
        """Counts over r's output so far (its own tokens, then its drafts, if any), and whether
        its last token is a PLACEHOLDER not counted yet: the caller adds that one on the device
        (it is counted as of now)."""
        base = r.num_output_tokens - len(r.extra)
        in_flight = False
        if base > self.counted:
            new = r.all_token_ids[r.num_prompt_tokens + self.counted : r.num_prompt_tokens + base]
            in_flight = new[-1] == PLACEHOLDER
            if in_flight:
                new = new[:-1]
            if PLACEHOLDER in new:  # (one step at most is in flight: only the last token can be)
                raise RuntimeError("a penalty row holds a placeholder before its last token")
            self._add(self.counts, new)
            self.counted = base
        if not r.extra:
            return self.counts, in_flight
        counts = self.counts.clone()
        self._add(counts, r.extra)
        return counts, in_flight
