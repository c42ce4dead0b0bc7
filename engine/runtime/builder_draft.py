"""Speculative decoding's parts at start-up (EngineBuilder's, engine/runtime/builder.py): the
scheduler's SpecDecoder, the draft model or EAGLE head with its own attention backend, and the
draft's runner and the proposer that drives it inside the target runner's launch."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config.settings import EngineSettings
from engine.layers.attention.selector import attention_backend_for
from engine.layers.kv_cache import KVCache
from engine.models.config import ModelConfig
from engine.models.draft import DraftParts, check_draft_model, load_draft_vocab
from engine.models.eagle import Eagle3Head, EagleConfig, EagleHead, load_eagle
from engine.models.llama import LlamaForCausalLM
from engine.models.loader.gguf_file import is_gguf
from engine.models.loader.model_loader import load_model
from engine.runtime.startup_phase import Phase
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.sched import DraftLengthPlanner, NgramProposer, SpecDecodeConfig, SpecDecoder
from engine.worker.model_runner import ModelRunner
from engine.worker.sample.sampler import Sampler

logger = logging.getLogger(__name__)


def make_spec_decoder(s: EngineSettings, max_model_len: int) -> SpecDecoder | None:
    """The scheduler's side of speculative decoding: n-gram drafts, or how many drafts the
    device proposer makes for each sequence, limited and accepted by a SpecDecoder."""
    if s.speculative_method is None:
        return None
    config = SpecDecodeConfig(s.num_speculative_tokens, s.speculative_method, s.prompt_lookup_max, s.prompt_lookup_min)
    proposer: NgramProposer | DraftLengthPlanner
    if not config.device_drafts:
        logger.info(
            "speculative decoding: ngram, up to %d draft tokens (lookup %d..%d tokens)",
            s.num_speculative_tokens,
            s.prompt_lookup_min,
            s.prompt_lookup_max,
        )
        proposer = NgramProposer(config)
    else:
        logger.info(
            "speculative decoding: %s %s, up to %d draft tokens per step",
            s.speculative_method,
            s.speculative_model,
            s.num_speculative_tokens,
        )
        proposer = DraftLengthPlanner(config)
    return SpecDecoder(proposer, max_model_len)


def verify_query(s: EngineSettings, is_draft_runner: bool) -> int:
    """Tokens per sequence of the verify steps a runner replays as graphs: the target's and an
    EAGLE head's catch-up (1 + the most drafts); a draft model's forwards are decode steps."""
    if s.speculative_method is None or (is_draft_runner and s.speculative_method == "draft_model"):
        return 1
    return 1 + s.num_speculative_tokens


def load_draft(
    s: EngineSettings,
    target: LlamaForCausalLM,
    target_config: ModelConfig,
    vocab_len: int,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> DraftParts | None:
    """The draft model (or EAGLE head) with its own attention backend; its KV cache is made
    with the target's once the pool is sized (the same block ids index both). vocab_len: the
    target tokenizer's."""
    if s.speculative_method not in ("draft_model", "eagle", "eagle3"):
        return None
    assert s.speculative_model is not None  # (the settings require one for these methods)
    path = Path(s.speculative_model).expanduser()
    if not path.is_dir() and not (s.speculative_method == "draft_model" and is_gguf(path)):
        raise ValueError(
            f"speculative_model: {s.speculative_model!r} is not a checkpoint directory"
            + (" or .gguf file" if s.speculative_method == "draft_model" else "")
        )
    vocab_ids = None
    model: LlamaForCausalLM | EagleHead | Eagle3Head
    config: ModelConfig | EagleConfig
    with Phase(f"loading the {s.speculative_method} draft {path}"):
        if s.speculative_method == "draft_model":
            config = layers = ModelConfig.from_dir(path, s.cache_dir)
            check_draft_model(config, target_config, vocab_len, path)
            model = load_model(
                path,
                config,
                dtype,
                device,
                max_model_len,
                s.load_format,
                s.seed,
                quant_activations=s.cpu_quant_activations,
            )
            vocab_ids = load_draft_vocab(path, config, target_config.vocab_size)
        else:
            model = load_eagle(path, 3 if s.speculative_method == "eagle3" else 1, target, dtype, device, max_model_len)
            config, layers = model.eagle, model.eagle.layer
    backend = attention_backend_for(s, layers, device, dtype)
    model.set_backend(backend)
    return DraftParts(model, config, backend, vocab_ids)


def make_device_proposer(
    s: EngineSettings,
    draft: DraftParts,
    draft_kv: KVCache,
    target: LlamaForCausalLM,
    target_runner: ModelRunner,
    target_config: ModelConfig,
    sampler: Sampler,
    dtype: torch.dtype,
    device: torch.device,
    token_budget: int,
    max_model_len: int,
) -> ModelRunner:
    """The draft's runner (its own input buffers, cache tensor and graphs) and the proposer that
    drives it inside the target runner's launch; the target's block copies cover its cache."""
    runner = ModelRunner(
        draft.model, draft_kv, sampler, device, s.block_size, s.max_num_seqs, token_budget, max_model_len
    )
    runner.builder.shifts_from = target_runner.builder  # (a verify step in flight moves its positions too)
    if s.speculative_method == "draft_model":
        target_runner.spec = DraftModelProposer(runner, target_config.vocab_size, sampler.generator, draft.vocab_ids)
    else:
        head = draft.model
        assert isinstance(head, (EagleHead, Eagle3Head))  # (an EAGLE method's draft is its head)
        head.allocate_inputs(runner.buffers.max_tokens)
        if head.eagle.version == 3:  # the target keeps the hidden states entering the head's layers
            target.aux_layers = head.eagle.aux_layers
            target.aux_hidden = torch.zeros(
                target_runner.buffers.max_tokens,
                len(head.eagle.aux_layers) * target_config.hidden_size,
                dtype=dtype,
                device=device,
            )
        target_runner.spec = EagleProposer(runner, target_runner, sampler.generator)
    target_runner.block_copy_caches.append(draft_kv.tensor)
    return runner
