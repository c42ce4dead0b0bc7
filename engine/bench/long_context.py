"""`kiln bench latency --context-depth D1,D2,...`: decode and prefill at long context, batch 1.

    kiln bench latency --preset smollm2-135m --context-depth 0,4k,16k,32k --output-len 32

For each depth D one request of D random prompt tokens (1 at depth 0) generates --output-len
tokens greedily: `prefill_tok_per_s` is D over the time to its first token, `decode_tok_per_s`
the tokens after the first over the time after it. Two engines on the same weights run each
depth in turn, interleaved over --rounds rounds (medians reported): the engine as configured
(the CPU default: a half-precision KV cache, attention that splits a long context across the
threads) and a baseline as kiln was before, a float32 KV cache with the decoder stack's
attention on one thread (its team mode at every depth). Their ratio is the gain; both run in
the same process, on the same machine load; the best of the rounds is printed beside the medians
(on a shared machine the best is the steadier figure). Every prompt is new (no prefix-cache hits).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from engine.core.params import SamplingParams

BASELINE = dict(kv_cache_dtype="float32")
# The decoder stack's team (attention on thread 0 alone) at every depth: kiln's attention before it
# split long contexts across the threads (templates/cpu_decoder_stack.inc, team_max_keys).
NO_SPLIT_TEAM_MAX_KEYS = 1 << 40
WARMUP_DEPTH, WARMUP_TOKENS = 64, 4  # a first request per engine, not measured


def parse_depths(text: str) -> list[int]:
    """ "0,4k,16k" -> [0, 4096, 16384] (k = 1024)."""
    depths = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        depths.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    if not depths or min(depths) < 0:
        raise ValueError(f"--context-depth: expected depths >= 0 like 0,4k,16k, got {text!r}")
    return depths


def measure(engine, depth: int, output_len: int, vocab: int, seed: int) -> dict[str, float]:
    """One request at `depth`: prefill and decode tokens per second."""
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(5, vocab - 1) for _ in range(max(depth, 1))]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    engine.add_request(prompt, params, request_id=f"depth-{depth}-{seed}")
    t0 = time.perf_counter()
    first = None
    while engine.core.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    end = time.perf_counter()
    engine.core.check_integrity()
    assert first is not None
    return {
        "prefill_tok_per_s": len(prompt) / (first - t0),
        "decode_tok_per_s": (output_len - 1) / (end - first),
    }


def run(settings, depths: list[int], output_len: int, rounds: int, json_path: str | None) -> int:
    import torch

    from engine.runtime.llm_engine import LLMEngine

    need = max(*depths, WARMUP_DEPTH) + max(output_len, WARMUP_TOKENS) + 1
    settings = settings.model_copy(update=dict(max_model_len=need, enable_prefix_caching=False, max_num_seqs=1))
    settings = type(settings)(**settings.model_dump(exclude_unset=False))  # re-validate
    engines = {"kiln": LLMEngine.from_settings(settings)}
    base = type(settings)(**{**settings.model_dump(exclude_unset=False), **BASELINE})
    engines["baseline"] = LLMEngine.from_settings(base)
    stack = getattr(engines["baseline"].core.model, "cpu_stack", None)
    if stack is not None:
        stack.stack.set_team_max_keys(NO_SPLIT_TEAM_MAX_KEYS)
    core = engines["kiln"].core
    vocab = engines["kiln"].model_config.vocab_size
    print(
        f"kiln bench latency --context-depth: {settings.model} ({str(core.dtype).removeprefix('torch.')}, "
        f"{core.device}, {torch.get_num_threads()} threads), batch 1, {output_len} output tokens, {rounds} interleaved "
        f"rounds (medians); kiln: KV {str(core.kv_cache.dtype).removeprefix('torch.')}, baseline: KV float32, "
        "attention on one thread"
    )
    for name, engine in engines.items():  # warm-up (first-call costs out of the figures)
        measure(engine, WARMUP_DEPTH, WARMUP_TOKENS, vocab, seed=-1)
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(rounds):
        for depth in depths:
            for name, engine in engines.items():
                samples.setdefault((name, depth), []).append(measure(engine, depth, output_len, vocab, seed=r))
    rows = []
    print(f"  {'depth':>6}  {'decode tok/s':>24}  {'prefill tok/s':>24}")
    print(f"  {'':>6}  {'kiln':>7} {'base':>7} {'ratio':>7}  {'kiln':>7} {'base':>7} {'ratio':>7}")
    for depth in depths:
        row: dict[str, Any] = {"depth": depth}
        for name in engines:
            for key in ("decode_tok_per_s", "prefill_tok_per_s"):
                row[f"{name}_{key}"] = statistics.median(s[key] for s in samples[(name, depth)])
                row[f"{name}_{key}_best"] = max(s[key] for s in samples[(name, depth)])
        for key in ("decode_tok_per_s", "prefill_tok_per_s"):
            row[f"ratio_{key}"] = row[f"kiln_{key}"] / row[f"baseline_{key}"]
            row[f"ratio_{key}_best"] = row[f"kiln_{key}_best"] / row[f"baseline_{key}_best"]
        rows.append(row)
        print(
            f"  {depth:>6}  {row['kiln_decode_tok_per_s']:7.1f} {row['baseline_decode_tok_per_s']:7.1f} "
            f"{row['ratio_decode_tok_per_s']:6.2f}x  {row['kiln_prefill_tok_per_s']:7.0f} "
            f"{row['baseline_prefill_tok_per_s']:7.0f} {row['ratio_prefill_tok_per_s']:6.2f}x"
            + f"   best of {rounds}: decode {row['ratio_decode_tok_per_s_best']:.2f}x, "
            f"prefill {row['ratio_prefill_tok_per_s_best']:.2f}x" + ("  (prefill of 1 token)" if depth == 0 else "")
        )
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))
    return 0
