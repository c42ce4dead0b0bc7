"""What a request's steps are for: its task (one per request, carried by each scheduled sequence).

    Generate     sample tokens (the default)
    ScorePrompt  sample tokens, and score every prompt token (SamplingParams.prompt_logprobs)
    Pool         no tokens: the prompt's final hidden states pooled into an embedding (PoolingParams)

The scheduler, runner, sampler and output processor call a task through this interface and
never branch on the feature themselves:
  - `sample_rows(s)`: how many sampler rows a scheduled sequence takes this step;
  - `prefix_cacheable`: may the prompt skip blocks found in the prefix cache;
  - `plan(s, row, history)` while the step's inputs are built (history: the worker's copy of the
    sequence's tokens): what the task takes from the step's hidden states (None: nothing); the
    worker reads it once the forward ran (engine/worker/task_reads.py,
    the device half of the kinds). Tasks read prompt positions only: a step of decodes alone is
    built without asking them;
  - `record(seq, result)` on the host: fold that into the request; True when the request is done;
  - `text_output`: False for a task without generated text (its result travels in the request's
    last update: engine/core/outputs.py).

Importable without torch (the scheduler is plain Python): tensors only pass through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from engine.core import admission_rules as rules
from engine.core.params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from engine.core.request import Request, Sequence


class StepShare(Protocol):
    """What a kind reads of a sequence's share of a step (engine/core/sched/scheduler_output.py's
    ScheduledSeq, which carries the kind: named here as a protocol, not imported)."""

    do_sample: bool
    num_samples: int
    draft_token_ids: list[int]
    start_pos: int
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int: ...


class Task:
    """The interface (see the module docstring); Generate, ScorePrompt and Pool implement it."""

    text_output: bool = True  # its outputs are generated text (False: an embedding)
    reads_hidden: bool = False  # plan() names something the worker reads from the step's hidden states

    @property
    def prefix_cacheable(self) -> bool:
        return True

    def check(self, model_config, model_name: str) -> None:
        """Refuse (InvalidRequestError) a request this model cannot serve with this task."""

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """The sampling params the request runs with."""
        raise NotImplementedError

    @staticmethod
    def sample_rows(s: StepShare) -> int:
        raise NotImplementedError

    def plan(self, s: StepShare, row: int, history: list[int]) -> Any:
        """While the step is built (s's tokens start at hidden row `row`; history: the sequence's
        tokens): what the worker's read will need, or None when there is nothing to read this step."""
        return None

    def record(self, seq: "Sequence", result: Any) -> bool:
        raise NotImplementedError


class Generate(Task):
    """Sample tokens: one row per sampling sequence, n at a fork point, one per position with drafts."""

    def check(self, model_config, model_name: str) -> None:
        rules.model_generates(model_config, model_name)

    def params(self, params: SamplingParams | None) -> SamplingParams:
        return params or SamplingParams()

    @staticmethod
    def sample_rows(s: StepShare) -> int:
        if not s.do_sample:
            return 0
        return 1 + len(s.draft_token_ids) if s.draft_token_ids else s.num_samples


class ScorePrompt(Generate):
    """Generate, and return the logprobs of the prompt's own tokens (every prompt position is
    computed: no prefix cache). Hidden row `row + k` predicts prompt token `first + k`."""

    prefix_cacheable = False
    reads_hidden = True

    def __init__(self, top_n: int) -> None:
        self.top_n = top_n

    def plan(self, s: StepShare, row: int, history: list[int]) -> tuple[int, int, list[int]] | None:
        start = s.start_pos
        last = min(start + s.num_tokens, s.num_prompt_tokens - 1)  # position j predicts prompt token j + 1
        if start >= last:
            return None
        return row, start + 1, history[start + 1 : last + 1]

    def record(self, seq: "Sequence", result: tuple[int, list[dict[int, float]]]) -> bool:
        first, entries = result  # (a prompt recomputed after preemption scores its tokens again)
        # (the request's list exists: a ScorePrompt request has params.prompt_logprobs set)
        assert seq.request.prompt_logprobs is not None
        seq.request.prompt_logprobs[first : first + len(entries)] = entries
        return False


class Pool(Task):
    """An embedding: the prompt's final hidden states, the last token's or their mean, cut to
    `dimensions` and L2-normalised as PoolingParams says; nothing is sampled."""

    text_output = False
    reads_hidden = True

    def __init__(self, pooling: PoolingParams) -> None:
        self.pooling = pooling  # (nothing else: the running mean is the request's, Request.pooled)

    @property
    def prefix_cacheable(self) -> bool:
        return self.pooling.pooling_type != "mean"  # the mean needs every prompt position computed

    def check(self, model_config, model_name: str) -> None:
        rules.dimensions_fit(self.pooling.dimensions, model_config.hidden_size)

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """(The request's sampling params are ignored: one step per chunk, final output only.)"""
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind="final_only")

    @staticmethod
    def sample_rows(s: StepShare) -> int:
        return 0

    def plan(self, s: StepShare, row: int, history: list[int]) -> tuple[int, int, int, bool] | None:
        final = s.do_sample  # the chunk ends the prompt
        if self.pooling.pooling_type != "mean" and not final:
            return None
        return row, s.num_tokens, s.start_pos, final

    def record(self, seq: "Sequence", result: tuple[Any, int, int, bool]) -> bool:
        vector, rows, start, final = result
        request = seq.request
        if self.pooling.pooling_type == "mean":
            total, count = (None, 0) if start == 0 or request.pooled is None else request.pooled  # (start 0: again,
            total = vector if total is None else total + vector  # after a preemption by recompute)
            count += rows
            request.pooled = (total, count)
            vector = total / count
        if not final:
            return False
        if self.pooling.dimensions is not None:
            vector = vector[: self.pooling.dimensions]
        if self.pooling.normalize:  # (torch.nn.functional.normalize's rule, with tensor methods)
            vector = vector / vector.norm().clamp_min(1e-12)
        request.embedding = vector.tolist()
        request.pooled = None
        return True


GENERATE = Generate()  # stateless: shared by every plain generation request


def make_task(params: SamplingParams | None, pooling: PoolingParams | None) -> Task:
    if pooling is not None:
        return Pool(pooling)
    if params is not None and params.prompt_logprobs is not None:
        return ScorePrompt(params.prompt_logprobs)
    return GENERATE


def task_of(request: "Request") -> Task:
    """The request's task (made from its params for a request built without one)."""
    if request.task is None:
        request.task = make_task(request.params, None)
    return request.task
