"""Running an admitted completion or chat request: as a job (streamed or collected), or with
use_beam_search (vLLM's extension) through engine/runtime/beam_search.py's driver, each step's
one-token requests run together."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from engine.core import admission_rules as rules
from engine.core.params import LoRARequest, SamplingParams
from engine.core.request_kinds import Task
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.jobs import Choice, Formatter, Job, respond, start_job
from engine.runtime.admission import AdmittedRequest
from engine.runtime.beam_search import BeamSearch, BeamSearchParams


async def beam_search(
    state,
    body,
    kind: str,
    prompts: list[list[int]],
    texts: list[str | None],
    params: SamplingParams,
    lora: LoRARequest | None,
) -> tuple[Job, list]:
    """(a job holding the usage, [(choice, output)]) of n beams per prompt, best first."""
    rules.beam_search_alone(
        bool(body.stream), params.structured_outputs is not None or bool(getattr(body, "tools", None))
    )
    info = state.info
    max_tokens = params.max_tokens or info.max_model_len - max(len(p) for p in prompts)
    search_params = BeamSearchParams(params.n, max_tokens, params.ignore_eos, body.length_penalty)
    search = BeamSearch(prompts, search_params, state.admission, info.eos_token_ids)

    async def one_step(admitted: AdmittedRequest) -> dict[int, float]:
        stream = await state.engine.submit(admitted)
        last = None
        try:
            async for last in stream:
                pass
        finally:
            stream.close()
        if last is None or last.error or not last.outputs[0].logprobs:
            raise APIError(
                500,
                f"a beam search step failed in the engine: {last.error if last else '?'}",
                "server_error",
                None,
                "engine_error",
            )
        return last.outputs[0].logprobs[-1]

    async def run_batch(batch: list[list[int]]) -> list[dict[int, float]]:
        return list(
            await asyncio.gather(*(one_step(search.step_request(tokens, body.priority, lora)) for tokens in batch))
        )

    await search.run(run_batch)
    job_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    job = Job(job_id, kind, [], params.n, texts, params)
    job.echo = getattr(body, "echo", False)
    results = []
    for ids, out in zip(prompts, search.outputs([job_id] * len(prompts), texts, state.tokenizer)):
        job.num_prompt_tokens += len(ids)
        for c in out.outputs:
            job.num_completion_tokens += len(c.token_ids)
            results.append(
                (
                    Choice(
                        text=c.text, token_ids=c.token_ids, logprobs=c.logprobs or [], finish_reason=c.finish_reason
                    ),
                    out,
                )
            )
    return job, results


async def generate(
    state,
    body,
    request,
    fmt: Formatter,
    kind: str,
    ids: list[list[int]],
    texts: list[str | None],
    params: SamplingParams,
    task: Task,
    grammar: Any,
    lora: LoRARequest | None,
    **job_fields,
):
    """The response to an admitted request (its params and task checked, its prompts fitted, its
    constraint compiled): its beams, or its job's stream or body (job_fields set on the job:
    echo, tool_mode, ...)."""
    if body.use_beam_search:
        job, results = await beam_search(state, body, kind, ids, texts, params, lora)
        return fmt.final_body(job, results)
    job_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    admitted = [
        state.admission.request(
            None, prompt, params, task, f"{job_id}-{i}", body.priority, arrival, lora, grammar, output_kind="delta"
        )
        for i, prompt in enumerate(ids)
    ]
    job = await start_job(state.engine, state.jobs, job_id, kind, admitted, texts, params)
    for name, value in job_fields.items():
        setattr(job, name, value)
    return await respond(
        job,
        fmt,
        state.model_name,
        body.stream,
        body.include_usage,
        request,
        state.settings.request_timeout,
        body.continuous_usage,
    )
