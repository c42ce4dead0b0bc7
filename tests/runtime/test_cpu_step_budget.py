"""engine/runtime/builder_cpu.py: a CPU step holds at most CPU_STEP_TOKENS tokens unless
max_num_batched_tokens is set (issue 40: a 2048-token step's float32 activations were the largest
part of a 1B GGUF model's peak above its weights)."""

from __future__ import annotations

from engine.config.settings import EngineSettings
from engine.runtime.builder_cpu import CPU_STEP_TOKENS, step_token_budget


def test_the_cpu_budget_unless_set(monkeypatch):
    assert CPU_STEP_TOKENS == 512
    assert step_token_budget(EngineSettings()) == CPU_STEP_TOKENS
    assert step_token_budget(EngineSettings(max_num_batched_tokens=2048)) == 2048  # (set: as set, even the default)
    assert step_token_budget(EngineSettings(max_num_batched_tokens=64)) == 64
    monkeypatch.setenv("KILN_MAX_NUM_BATCHED_TOKENS", "1024")
    assert step_token_budget(EngineSettings()) == 1024


def test_a_cpu_engine_schedules_with_it(make_llm):
    llm = make_llm(max_model_len=1024)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == CPU_STEP_TOKENS
    set_ = make_llm(max_model_len=1024, max_num_batched_tokens=1024)
    assert set_.engine.core.scheduler.config.max_num_batched_tokens == 1024


def test_a_wave_of_16_x_64_prompt_rows_runs_as_two_steps_with_the_tokens_of_one(make_llm):
    """cpu_prefill_wave_tokens (engine/core/sched/step_budget.py PrefillWave): the wave's 1,024 rows run
    as two 512-row steps, the first sampling nothing, and every sequence's greedy tokens are those of
    one 1,024-row step and of the old split (half the first tokens a step early)."""
    from engine.core.params import SamplingParams

    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(64)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for name, kw in (
        ("wave", {}),
        ("one step", {"max_num_batched_tokens": 1024}),
        ("old", {"cpu_prefill_wave_tokens": 0}),
    ):
        llm = make_llm(max_model_len=1024, **kw)
        sched = llm.engine.core.scheduler
        steps = []
        schedule = sched.schedule

        def recorded(schedule=schedule, steps=steps):
            out = schedule()
            if out.num_prefill_tokens:
                steps.append((out.num_tokens, sum(s.do_sample for s in out.seqs)))
            return out

        sched.schedule = recorded
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        want = {"wave": [(512, 0), (512, 16)], "one step": [(1024, 16)], "old": [(512, 8), (512, 15), (23, 16)]}[name]
        assert steps == want, name
    assert tokens["wave"] == tokens["one step"] == tokens["old"]
