"""One step's plan, as the scheduler hands it to the runner: a plain message, no tensors and
no live core object (no Sequence, no list the core goes on writing).

`SchedulerOutput` lists each sequence's share of the step (`ScheduledSeq`) and the block
copies to queue before the forward (copy-on-write, swap out, swap in). Block tables and token
histories travel as deltas (engine/core/sched/deltas.py): a record says from which column its
sequence's table changed since the last message that carried it and the table from there,
and the same of its tokens; the worker keeps its own copy of each sequence (engine/worker/
seq_states.py) and drops those the message lists (finished or preempted). What the step
computes (sampled tokens, a device proposer's drafts) comes back in the runner's output
(engine/core/outputs.py SamplerOutput), and the core applies it; what the worker needs of the
core's state at sampling time it is handed then (a grammar's bitmask, the tokens learnt since
the launch). The scheduler reuses a decode's record object in a later step once
the step that held it has been processed: the worker keeps nothing of a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.params import SamplingParams
from engine.core.request_kinds import GENERATE, Task, task_of

if TYPE_CHECKING:
    from engine.core.request import Sequence


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `token_ids` at positions start_pos.. are computed."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    # The block table as a delta: the worker's table[blocks_from:] = new_block_ids (a copy; 0 and
    # the whole table for a sequence the worker has no copy of, or whose table changed in place).
    blocks_from: int
    new_block_ids: list[int]
    do_sample: bool  # the chunk reaches the end of the sequence: sample the next token
    num_samples: int  # n > 1 at a request's fork point, else 1
    params: SamplingParams
    # Prompt + output so far as a delta: the worker's history[history_from:] = new_history (a copy;
    # PLACEHOLDER for tokens of launched steps; read for penalties, processors, prompt logprobs).
    history_from: int
    new_history: list[int]
    num_prompt_tokens: int
    sample_index: int
    # Structured outputs: the request has grammar matchers (the core's); the core fills this
    # record's rows of the step's bitmask (engine/structured_output/step_bitmask.py).
    constrained: bool = False
    # Speculative decoding: token_ids is [last token, *drafts]; every position is sampled.
    draft_token_ids: list[int] = field(default_factory=list)
    task: Task = GENERATE  # what the step is for (engine/core/request_kinds.py)
    lora_slot: int = -1  # the request's LoRA adapter slot (-1: the base model)
    # Scheduled while the sequence's verify step was in flight: its positions are the worst case
    # (every draft kept), which the device moves back by what was not (engine/spec_decode/verify.py).
    after_verify: bool = False
    # One sampled token at most and no fork, drafts or task results: the scheduler counts the
    # tokens computed, and a placeholder for the sampled one, as soon as the step is launched.
    # (Set once: a record's drafts, samples and task never change; read for every row every step.)
    advances_at_launch: bool = field(init=False)
    # A verify step's record (drafts after the last token): at launch the sequence advances as if
    # every draft will be kept (placeholders for all of them and the token after), and its results
    # correct that (engine/spec_decode/sched/decoder.py accept_launched).
    verifies: bool = field(init=False)

    def __post_init__(self) -> None:
        self.advances_at_launch = not self.draft_token_ids and self.num_samples == 1 and self.task.text_output
        self.verifies = bool(self.draft_token_ids) and self.num_samples == 1 and self.task.text_output

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def sample_row_ranges(seqs: list[ScheduledSeq]):
    """(scheduled seq, range of its rows in the step's flat sampler output): one row per
    sampling sequence, n at a fork point, none for a prefill chunk that does not end the prompt."""
    k = 0
    for s in seqs:
        n = s.task.sample_rows(s)
        yield s, range(k, k + n)
        k += n


def scheduled_seq(
    seq: "Sequence", start: int, num_new: int, drafts: list[int], delta: tuple, after_verify: bool
) -> ScheduledSeq:
    """The record of `num_new` tokens of `seq` from position `start` (the last len(drafts) of them
    drafts); `delta`: its block table's and tokens' change since the worker's copy (SeqDeltas.delta)."""
    request = seq.request
    do_sample = start + num_new - len(drafts) == seq.num_tokens
    fork = do_sample and request.params.n > 1 and not request.forked
    blocks_from, new_block_ids, history_from, new_history = delta
    return ScheduledSeq(
        seq_id=seq.seq_id,
        token_ids=seq.token_ids[start : start + num_new - len(drafts)] + drafts,
        start_pos=start,
        blocks_from=blocks_from,
        new_block_ids=new_block_ids,
        do_sample=do_sample,
        num_samples=request.params.n if fork else 1,
        params=request.params,
        history_from=history_from,
        new_history=new_history,
        num_prompt_tokens=seq.num_prompt_tokens,
        sample_index=seq.sample_index,
        constrained=bool(request.grammars),
        draft_token_ids=drafts,
        task=task_of(request),
        lora_slot=request.lora_slot,
        after_verify=after_verify,
    )


# Stand-in for a token a launched step samples, until the host learns it (overlap scheduling);
# the runner feeds the real id to the next step on the device.
PLACEHOLDER = -1


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # gpu -> cpu
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # cpu -> gpu
    preempted: list[int] = field(default_factory=list)  # seq ids
    # Seq ids whose copies (block table, tokens) the worker drops (finished or preempted since the
    # last message with sequences), before it applies this message's deltas.
    dropped_seqs: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    launched: bool = False  # Scheduler.launched() has advanced its sequences

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.blocks_to_copy and not self.blocks_to_swap_out and not self.blocks_to_swap_in
