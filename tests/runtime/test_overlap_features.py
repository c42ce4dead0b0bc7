"""Overlap scheduling with the features whose steps used to run serially: penalties, grammars
(structured outputs), logits processors, n > 1. Overlap on and off give the same outputs (greedy
and seeded sampling), mixed with plain requests, under KV pressure (swap and recompute); no KV
block leaks; and such steps really overlap: step N+1 is launched before step N is processed
(counted from the order of the engine's calls, not timed)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.core.params import StructuredOutputsParams
from tests.support.engine import assert_engine_clean
from tests.support.overlap import PROMPTS, _summary

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
REGEX = StructuredOutputsParams(regex=r"[a-c]{2,4}-\d{2}")
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
CHOICE = StructuredOutputsParams(choice=["yes", "no"])


class _CallOrder:
    """Records the engine's launches, deferred samplings and processings, in order, each with the
    step's features: ("launch"|"sample"|"process", step number, frozenset of features)."""

    def __init__(self, engine) -> None:
        self.events: list[tuple[str, int, frozenset]] = []
        self._ids: dict[int, int] = {}
        self._keep: list = []  # (the steps stay alive: their ids are not reused)
        runner, scheduler = engine.core.runner, engine.core.scheduler
        launch, sample, process = runner.launch, runner.sample, scheduler.update_from_output

        inside = []  # (launch samples a step that does not defer through the same method)

        def launched(sched, *args, **kwargs):
            self._ids[id(sched)] = len(self._ids)
            self._keep.append(sched)
            self._log("launch", sched)
            inside.append(True)
            try:
                return launch(sched, *args, **kwargs)
            finally:
                inside.pop()

        def sampled(sched, pending, *args):
            if not inside:
                self._log("sample", sched)
            return sample(sched, pending, *args)

        def processed(sched, out):
            self._log("process", sched)
            return process(sched, out)

        runner.launch, runner.sample, scheduler.update_from_output = launched, sampled, processed

    def _log(self, what: str, sched) -> None:
        features = set()
        for s in sched.seqs:
            p = s.params
            if p.needs_penalties:
                features.add("penalties")
            if s.constrained:
                features.add("grammar")
            if p.logits_processors:
                features.add("processors")
            if p.n > 1 and s.advances_at_launch:
                features.add("n>1")
        self.events.append((what, self._ids[id(sched)], frozenset(features)))

    def overlapped(self, feature: str) -> int:
        """Steps with `feature` launched while the previous launched step was not processed yet."""
        processed: set[int] = set()
        count = 0
        for what, step, features in self.events:
            if what == "process":
                processed.add(step)
            elif what == "launch" and feature in features and step > 0 and step - 1 not in processed:
                count += 1
        return count

    def deferred_after_processing(self) -> int:
        """Deferred samplings that came after the previous step was processed (and after their
        own launch): the grammar saw the previous token, the forward ran meanwhile."""
        processed: set[int] = set()
        launched: set[int] = set()
        count = 0
        for what, step, _ in self.events:
            if what == "process":
                processed.add(step)
            elif what == "launch":
                launched.add(step)
            elif what == "sample":
                assert step in launched and step - 1 in processed, "sampled before the previous step was processed"
                count += 1
        return count


def _pair(tiny_llama, **settings):
    """Serial and overlapped LLMs over the same settings, and the overlapped one's call order.
    (Module-scoped: an engine's first grammar costs seconds, so the tests share them.)"""
    from engine.entrypoints.llm import LLM

    settings = dict(enforce_eager=True, device="cpu", **settings)
    serial = LLM(str(tiny_llama), async_scheduling=False, **settings)
    overlap = LLM(str(tiny_llama), async_scheduling=True, **settings)
    return serial, overlap, _CallOrder(overlap.engine)


@pytest.fixture(scope="module")
def shared_pair(tiny_llama):
    return _pair(tiny_llama, max_num_seqs=8)


@pytest.fixture
def pair(shared_pair):
    shared_pair[2].events.clear()
    yield shared_pair
    for llm in shared_pair[:2]:
        assert_engine_clean(llm.engine)


@pytest.fixture(scope="module")
def pressure_pair(tiny_llama):
    return _pair(
        tiny_llama, num_gpu_blocks=12, max_model_len=96, max_num_seqs=6, preemption_mode="swap", swap_space_gb=0.01
    )


def _generate(llm, prompts, params):
    outs = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert_engine_clean(llm.engine)
    return outs


def test_penalties_overlap_and_equal_serial(pair):
    serial, overlap, order = pair
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(
            temperature=0.9,
            seed=4,
            max_tokens=22,
            ignore_eos=True,
            frequency_penalty=0.5,
            presence_penalty=0.4,
            repetition_penalty=1.2,
        ),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),  # plain, beside them
        SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True, frequency_penalty=0.9),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=2.0),  # ends early
    ]
    want = _generate(serial, PROMPTS, params)
    got = _generate(overlap, PROMPTS, params)
    assert got == want
    assert order.overlapped("penalties") > 10
    assert order.overlapped("n>1") > 3  # (the fork step itself is serial; its children decode overlapped)
    # the penalties matter: without them the greedy rows would decode something else
    plain = _generate(serial, PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3)
    assert [o[0][1] for o in plain] != [o[0][1][:24] for o in want[:3]]


def test_grammars_overlap_and_equal_serial(pair):
    """JSON schema, regex and choice grammars (greedy and seeded, n > 1), with plain and penalty
    requests in the same batch: the grammars finish at different steps while others go on, so
    a finished one's extra token must be discarded and its matcher never asked again."""
    serial, overlap, order = pair
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=REGEX),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30, structured_outputs=REGEX),
        SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=10, structured_outputs=CHOICE),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.8),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=3, frequency_penalty=0.4, structured_outputs=REGEX),
        SamplingParams(temperature=0.7, seed=5, max_tokens=40, structured_outputs=JSON),
    ]
    want = _generate(serial, PROMPTS, params)
    got = _generate(overlap, PROMPTS, params)
    assert got == want
    # the grammars stopped (in the language) while plain rows ran on: the case that matters
    assert all(c[3] == "stop" for i in (1, 2, 3, 6) for c in want[i]) and want[4][0][3] == "length"
    assert order.overlapped("grammar") > 5
    assert order.deferred_after_processing() > 5


def test_invalid_token_under_a_grammar_fails_alike(pair):
    """allowed_token_ids that leave the grammar no token: that request fails (no finite logit),
    the same way in both loops, and its batch-mates are untouched."""
    serial, overlap, _ = pair
    tokenizer = serial.engine.tokenizer
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex="[a-c]+x"),
            allowed_token_ids=[t for t in digits if t is not None],
        ),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=REGEX),
    ]

    def run(llm):
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert_engine_clean(llm.engine)
        return _summary(outs), [o.error is not None for o in outs]

    want = run(serial)
    assert want[1] == [False, True, False]
    assert run(overlap) == want


def test_logits_processors_overlap_and_see_the_serial_history(pair):
    """A user processor reads the output token ids on the host: with overlap it is called after
    the previous step was processed, so it sees exactly the serial loop's histories."""

    def make(seen):
        def proc(out_ids, row):
            seen.append(tuple(out_ids))
            row = row.clone()
            row[out_ids[-1] if out_ids else 0] -= 5.0  # no immediate repeats
            return row

        return proc

    serial, overlap, order = pair
    histories = {}
    for name, llm in (("serial", serial), ("overlap", overlap)):
        seen = histories[name] = []
        params = [
            SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logits_processors=[make(seen)]),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.5, seed=2, max_tokens=9, ignore_eos=True, logits_processors=[make(seen)]),
        ]
        histories[name + "_out"] = _generate(llm, PROMPTS[:3], params)
    assert histories["overlap_out"] == histories["serial_out"]
    assert sorted(histories["overlap"]) == sorted(histories["serial"])
    assert all(-1 not in h for h in histories["overlap"]), "a processor saw a placeholder"
    assert order.overlapped("processors") > 5


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_features_under_kv_pressure(pressure_pair, mode):
    serial, overlap, order = pressure_pair
    order.events.clear()
    for llm in (serial, overlap):  # (one pair of engines for both modes: the pool has swap space for "swap")
        llm.engine.core.scheduler.preemption.mode = mode
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.6),
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=REGEX, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    prompts = [PROMPTS[i] for i in (0, 3, 2, 7, 1, 5)]
    before = overlap.engine.core.scheduler.preemptions_by_mode[mode]
    want = _generate(serial, prompts, params + params[:2])
    got = _generate(overlap, prompts, params + params[:2])
    assert got == want
    assert overlap.engine.core.scheduler.preemptions_by_mode[mode] > before, "no preemption: no pressure"
    assert order.overlapped("penalties") > 5 and order.overlapped("grammar") > 0


def test_penalties_with_prefix_caching(pair):
    """Requests sharing a cached prefix, penalised by their prompt (repetition) and output."""
    serial, overlap, order = pair
    shared = list(range(10, 58))
    prompts = [shared + [100 + i] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5)

    def run(llm):
        hits = llm.engine.core.pool.counters.prefix_hits
        first = _generate(llm, prompts[:1], params)
        rest = _generate(llm, prompts[1:], params)
        assert llm.engine.core.pool.counters.prefix_hits - hits >= 4 * 48
        return first + rest

    assert run(overlap) == run(serial)
    assert order.overlapped("penalties") > 5


def test_penalty_counts_take_the_in_flight_token_on_the_device():
    """The sampler, fed histories ending in a PLACEHOLDER and the previous step's device tokens,
    penalises exactly as when the host knows every token (and goes on counting from there)."""
    from types import SimpleNamespace

    import torch

    from engine.core.sched.scheduler_output import PLACEHOLDER
    from engine.worker.sample.sampler import Sampler, SampleRow
    from engine.worker.sample.sampler_output import LastSampled

    params = SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.4)
    prompts = {7: [3, 4, 5], 9: [1, 1, 2]}
    outputs = {7: [8, 8, 3, 6], 9: [2, 5, 5, 5]}
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    known, fed = Sampler(torch.device("cpu"), (0,)), Sampler(torch.device("cpu"), (0,))
    for step in range(1, 5):
        rows_known = [SampleRow(params, prompts[k] + outputs[k][:step], 3, 0, key=k) for k in (7, 9)]
        rows_fed = [SampleRow(params, prompts[k] + outputs[k][: step - 1] + [PLACEHOLDER], 3, 0, key=k) for k in (7, 9)]
        # the previous step's tokens: seq 9 sampled row 0 and seq 7 row 1 (another order than this step's)
        last = LastSampled(
            torch.tensor([outputs[9][step - 1], outputs[7][step - 1]]),
            [SimpleNamespace(seq_id=9), SimpleNamespace(seq_id=7)],
            decode=True,
        )
        want = known._apply_penalties(logits, rows_known, None)
        got = fed._apply_penalties(logits, rows_fed, last)
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="in flight"):  # a placeholder no launched step holds
        Sampler(torch.device("cpu"), (0,))._apply_penalties(logits, rows_fed, None)
