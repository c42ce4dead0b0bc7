"""The offline API: `LLM(model=..., **settings).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any
from typing import Sequence as Seq

from engine.config.generation_config import default_sampling_params
from engine.config.process_setup import prepare_process
from engine.config.server_settings import ServerSettings
from engine.config.settings import EngineSettings
from engine.core.outputs import EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from engine.core.params import LoRARequest, PoolingParams, SamplingParams

# An entry point (`from engine import LLM`): the settings torch reads once at load, before the engine imports it.
prepare_process()

from engine.runtime.admission import AdmittedRequest  # noqa: E402
from engine.runtime.llm_engine import LLMEngine  # noqa: E402

if TYPE_CHECKING:
    from engine.runtime.beam_search import BeamSearchParams


# The server's grammar-compile settings (engine/config/settings.py ServerSettings) apply offline too.
GRAMMAR_SETTINGS = ("grammar_compile_timeout_s", "grammar_compile_workers")


# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts; one or a sequence of them.
Prompt = str | list[int] | dict[str, Any]
Prompts = Prompt | Seq[Prompt]


class LLM:
    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """settings: EngineSettings fields, plus grammar_compile_timeout_s / grammar_compile_workers
        (ServerSettings' defaults): a structured-output constraint that does not compile within
        the limit is an InvalidRequestError naming `structured_outputs`, as the server's 400."""
        if model is not None:
            settings["model"] = model
        grammar = _grammar_settings({name: settings.pop(name) for name in GRAMMAR_SETTINGS if name in settings})
        self.settings = EngineSettings(**settings)
        self.engine = LLMEngine.from_settings(self.settings)
        # Compiles run in killable worker processes (started on the first constrained request):
        # xgrammar cannot be interrupted in-process, and a pathological schema can take minutes.
        self.engine.structured_output.configure(
            timeout_s=grammar["grammar_compile_timeout_s"], workers=grammar["grammar_compile_workers"]
        )
        weakref.finalize(self, self.engine.structured_output.close)  # (its worker processes)
        if self.engine.core.kv_tiers is not None:  # (blocks still queued reach the tiers at exit)
            weakref.finalize(self, self.engine.core.kv_tiers.close)
        self._counter = 0

    def close(self) -> None:
        """Stop the grammar compile workers now and hand the KV tiers what they still queue (both also
        happen when the LLM is collected)."""
        self.engine.structured_output.close()
        self.engine.core.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (vLLM's LLM.get_tokenizer)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's idle blocks; returns how many (engine.reset_prefix_cache)."""
        return self.engine.core.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (vLLM's behaviour)."""
        return default_sampling_params(self.engine.generation_defaults)

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.
        lora_request: one adapter for all prompts, or one (or None) per prompt (enable_lora)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one LoRARequest or one per prompt")
        admission = self.engine.admission
        admitted = [
            admission.admit(
                prompt, params, self._next_id(), priority[i] if priority else 0, loras[i], output_kind="final_only"
            )
            for i, (prompt, params) in enumerate(zip(prompts, params_list))
        ]
        return self._run(admitted, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            for conv in conversations
        ]
        # The template already carries the special tokens: don't let the tokenizer add a second BOS.
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outputs, prompts):
            out.prompt = text  # (vLLM's chat outputs carry the rendered conversation)
        return outputs

    def embed(
        self,
        prompts: Prompts,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts (`.outputs.embedding`, as vLLM gives them; `.embedding` too), in
        input order: the final hidden states pooled as pooling_params says (default: the last
        token's, L2-normalised)."""
        pooling = pooling_params or PoolingParams(self.engine.settings.pooling_type)
        admission = self.engine.admission
        admitted = [
            admission.admit(prompt, None, self._next_id(), lora_request=lora_request, pooling=pooling)
            for prompt in _prompt_list(prompts)
        ]
        return [EmbeddingRequestOutput.of(out) for out in self._run(admitted, use_tqdm)]

    def score(
        self,
        data_1: Prompts,
        data_2: Prompts,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score with an embedding model: the cosine similarity of each pair's embeddings
        (LLM.embed's, default pooling). One prompt in data_1 is paired with each of data_2; else
        the two pair up in order and must be as many."""
        first, second = _prompt_list(data_1), _prompt_list(data_2)
        if not second or len(first) not in (1, len(second)):
            raise ValueError(f"score: data_1 is one prompt or as many as data_2 ({len(first)} and {len(second)} given)")
        first = first * len(second) if len(first) == 1 else first
        embedded = self.embed([*first, *second], use_tqdm=use_tqdm, lora_request=lora_request)
        out = []
        for a, b in zip(embedded[: len(first)], embedded[len(first) :]):
            dot = sum(x * y for x, y in zip(a.embedding, b.embedding))
            norms = (sum(x * x for x in a.embedding) * sum(y * y for y in b.embedding)) ** 0.5
            out.append(
                ScoringRequestOutput(
                    f"{a.request_id}-{b.request_id}",
                    a.prompt_token_ids + b.prompt_token_ids,
                    ScoringOutput(dot / norms if norms else 0.0),
                )
            )
        return out

    def classify(self, prompts: Prompts, *args: Any, **kwargs: Any) -> list:
        """vLLM's LLM.classify needs a sequence-classification head, which kiln does not load."""
        raise ValueError(
            "LLM.classify: kiln loads no sequence-classification models; with an embedding model, "
            "LLM.embed and LLM.score work"
        )

    def beam_search(
        self, prompts: Prompts, params: "BeamSearchParams", lora_request: LoRARequest | None = None
    ) -> list[RequestOutput]:
        """Beam search (engine/runtime/beam_search.py): per prompt, a RequestOutput whose outputs are the
        best params.beam_width beams, best first."""
        from engine.runtime.beam_search import BeamSearch

        engine = self.engine
        encoded = [engine.admission.encode(p) for p in _prompt_list(prompts)]
        search = BeamSearch([ids for _, ids in encoded], params, engine.admission, engine.eos_token_ids)

        def run_batch(batch: list[list[int]]) -> list[dict[int, float]]:
            admitted = [
                search.step_request(
                    tokens, lora_request=lora_request, request_id=self._next_id(), output_kind="final_only"
                )
                for tokens in batch
            ]
            return [out.outputs[0].logprobs[0] for out in self._run(admitted, use_tqdm=False)]

        search.run_sync(run_batch)
        return search.outputs([f"beam-{k}" for k in range(len(encoded))], [text for text, _ in encoded], self.tokenizer)

    def _next_id(self) -> str:
        request_id = f"offline-{self._counter}"
        self._counter += 1
        return request_id

    def _run(self, admitted: list[AdmittedRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Queue every admitted request (or, if the engine refuses one, none) and step until all
        are finished; their final outputs in order."""
        from tqdm import tqdm

        ids: list[str] = []
        try:
            for request in admitted:
                self.engine.submit(request)
                ids.append(request.request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req")
        try:
            while self.engine.core.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for request_id in ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
        return [results[i] for i in ids]


def _grammar_settings(given: dict[str, Any]) -> dict[str, Any]:
    """GRAMMAR_SETTINGS as given, else ServerSettings' defaults, validated by its field rules."""
    from typing import Annotated

    from pydantic import TypeAdapter

    out = {}
    for name in GRAMMAR_SETTINGS:
        field = ServerSettings.model_fields[name]
        value = given.get(name, field.default)
        try:
            out[name] = TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
    return out


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    """One prompt or several, as a list of prompts (strings or token-id lists). A prompt may be
    given as vLLM's TextPrompt ({"prompt": text}) or TokensPrompt ({"prompt_token_ids": ids})."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_plain_prompt(p) for p in prompts]


def _plain_prompt(prompt: Any) -> str | list[int]:
    if not isinstance(prompt, dict):
        return prompt
    if "multi_modal_data" in prompt or "multi_modal_uuids" in prompt:
        raise ValueError("multi_modal_data: kiln serves text-only models (no image, audio or video inputs)")
    if "prompt_embeds" in prompt:
        raise ValueError("prompt_embeds: kiln takes text or token ids, not prompt embeddings")
    kinds = [k for k in ("prompt", "prompt_token_ids") if k in prompt]
    if len(kinds) != 1:
        raise ValueError(
            f"a prompt dict needs exactly one of 'prompt' (TextPrompt) or 'prompt_token_ids' "
            f"(TokensPrompt); got keys {sorted(prompt)}"
        )
    return list(prompt["prompt_token_ids"]) if kinds[0] == "prompt_token_ids" else prompt["prompt"]
