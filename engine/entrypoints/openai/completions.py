"""POST /v1/completions and its response format."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.admission import (
    check_constraint,
    check_model,
    check_params,
    fit_prompts,
    prompt_ids,
    tenant_of,
)
from engine.entrypoints.openai.errors import post_route
from engine.entrypoints.openai.generation import generate
from engine.entrypoints.openai.generation_request import GenerationRequest
from engine.entrypoints.openai.jobs import Choice, FormatBase, Job, envelope
from engine.entrypoints.openai.protocol import CompletionRequest


class CompletionFormat(FormatBase):
    chunk_object = "text_completion"

    def first_chunks(self, job: Job) -> list[dict[str, Any]]:
        return []

    def _prompt_text(self, job: Job, pidx: int, out: RequestOutput) -> str:
        text = job.prompt_texts[pidx]
        return text if text is not None else self.state.tokenizer.decode(out.prompt_token_ids)

    def _with_echo(self, job: Job, pidx: int, out: RequestOutput, text: str, lp: dict | None):
        prefix = self._prompt_text(job, pidx, out)
        if lp is not None:
            lp = self.lp.echo(out.prompt_token_ids, out.prompt_logprobs, prefix, lp)
        return prefix + text, lp

    def stream_choice(
        self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool
    ) -> dict[str, Any]:
        text, lp = c.text, None
        if job.params.logprobs is not None:
            lp = self.lp.completion(ch, c.token_ids, c.logprobs or [])
        if first and job.echo:
            text, lp = self._with_echo(job, pidx, delta, text, lp)
        return {
            "index": idx,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def final_body(self, job: Job, results: list[tuple[Choice, RequestOutput | None]]) -> dict[str, Any]:
        choices = []
        for i, (ch, out) in enumerate(results):
            text, lp = ch.text, None
            if job.params.logprobs is not None:
                lp = self.lp.completion(ch, ch.token_ids, ch.logprobs)
            if job.echo and out is not None:
                text, lp = self._with_echo(job, i // job.n, out, text, lp)
            choice = {
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": ch.finish_reason,
                "stop_reason": ch.stop_reason,
            }
            if job.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.lp.prompt(out)
            choices.append(choice)
        return envelope(job, "text_completion", self.state.model_name, choices)


async def create_completion(state, body: CompletionRequest, request: Request):
    """Check the body's parts in order (model, params, prompts, the constraint), then run the one
    generation request they make."""
    lora = check_model(state, body.model)
    prompts = body.prompts()
    params, task = check_params(state, body.sampling_params(state.info.generation_defaults), len(prompts))
    ids = fit_prompts(state, await prompt_ids(state, prompts, "prompt"), params, "prompt")
    grammar = await check_constraint(state, params, body.constraint_field(), tenant_of(request, body.user), request)
    gen = GenerationRequest(
        "completion",
        ids,
        [p if isinstance(p, str) else None for p in prompts],
        params,
        task,
        grammar,
        lora,
        priority=body.priority,
        stream=bool(body.stream),
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
        echo=body.echo,
        prompt_only=body.prompt_only,
    )
    return await generate(state, gen, CompletionFormat(state), request)


def router(state) -> APIRouter:
    r = APIRouter()
    post_route(r, "/v1/completions", CompletionRequest, create_completion, state)
    return r
