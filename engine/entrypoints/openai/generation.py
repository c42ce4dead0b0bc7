"""Running a GenerationRequest: as a job (streamed or collected), or with use_beam_search (vLLM's
extension) through engine/runtime/beam_search.py's driver, each step's one-token requests run
together."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.generation_request import GenerationRequest
from engine.entrypoints.openai.jobs import Choice, EventWriter, Formatter, Job, respond, start_job
from engine.runtime.admission import AdmittedRequest
from engine.runtime.beam_search import BeamSearch, BeamSearchParams


async def beam_search(state, gen: GenerationRequest) -> tuple[Job, list]:
    """(a job holding the usage, [(choice, output)]) of n beams per prompt, best first."""
    info, params = state.info, gen.params
    max_tokens = params.max_tokens or info.max_model_len - max(len(p) for p in gen.prompts)
    search_params = BeamSearchParams(params.n, max_tokens, params.ignore_eos, gen.length_penalty)
    search = BeamSearch(gen.prompts, search_params, state.admission, info.eos_token_ids)

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
            await asyncio.gather(*(one_step(search.step_request(tokens, gen.priority, gen.lora)) for tokens in batch))
        )

    await search.run(run_batch)
    job_id = f"{gen.id_prefix}-{uuid.uuid4().hex}"
    job = Job(job_id, gen.kind, [], params.n, gen.texts, params, echo=gen.echo)
    results = []
    for ids, out in zip(gen.prompts, search.outputs([job_id] * len(gen.prompts), gen.texts, state.tokenizer)):
        job.num_prompt_tokens += len(ids)
        for c in out.outputs:
            job.num_completion_tokens += len(c.token_ids)
            results.append((Choice(c.text, c.token_ids, c.logprobs or [], c.finish_reason), out))
    return job, results


async def generate(state, gen: GenerationRequest, fmt: Formatter, request: Request, events: EventWriter | None = None):
    """The response to an admitted request: its beams, or its job's stream (framed by `events`,
    OpenAI's chunks by default) or body."""
    if gen.use_beam_search:
        job, results = await beam_search(state, gen)
        return fmt.final_body(job, results)
    job_id = f"{gen.id_prefix}-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    admitted = [
        state.admission.request(
            None,
            prompt,
            gen.params,
            gen.task,
            f"{job_id}-{i}",
            gen.priority,
            arrival,
            gen.lora,
            gen.grammar,
            output_kind="delta",
        )
        for i, prompt in enumerate(gen.prompts)
    ]
    job = await start_job(state.engine, state.jobs, job_id, admitted, gen)
    return await respond(job, fmt, state.model_name, gen, request, state.settings.request_timeout, events)
