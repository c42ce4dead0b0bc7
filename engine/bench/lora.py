"""`kiln bench lora`: what serving through LoRA adapters costs. The same greedy workload runs on
an engine without LoRA and on one with `--adapters` random rank-R adapters (every projection
targeted), requests spread round-robin over the adapters, in one run; prints output tokens/s
of both and the ratio. Adapters are written here in PEFT's format (random A and B), so no
adapter checkpoint is needed.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(config, out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for `config` (engine.models.config.ModelConfig) with random weights."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }
    tensors = {}
    for layer in range(config.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(PEFT_TARGETS),
                "bias": "none",
                "use_rslora": False,
                "use_dora": False,
            }
        )
    )
    return out_dir


def _run(llm, prompts, loras, max_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=loras[:2])  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str]) -> int:
    from engine.entrypoints.cli.flags import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser(prog="kiln bench lora", description=__doc__)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    add_settings_flags(parser, skip=("enable_lora", "lora_modules", "max_loras", "max_lora_rank"))
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    from engine import LoRARequest
    from engine.entrypoints.llm import LLM
    from engine.models.tiny_model import default_model_dir

    model = settings.model or str(default_model_dir(settings.cache_dir))
    common = settings.model_dump(exclude_unset=True) | {"model": model}
    base = LLM(**common)
    config = base.engine.model_config
    rng = random.Random(0)
    vocab = min(config.vocab_size, len(base.tokenizer))
    prompts = [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    base_s, base_tokens = _run(base, prompts, [None] * len(prompts), args.max_tokens)
    del base
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"adapter{i}", i + 1, str(write_random_adapter(config, Path(tmp) / f"a{i}", args.rank, seed=i)))
            for i in range(args.adapters)
        ]
        lora = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
        lora_s, lora_tokens = _run(lora, prompts, loras, args.max_tokens)
        lora.engine.core.check_integrity()
    result = {
        "model": model,
        "adapters": args.adapters,
        "rank": args.rank,
        "base_tok_per_s": base_tokens / base_s,
        "lora_tok_per_s": lora_tokens / lora_s,
        "ratio": (lora_tokens / lora_s) / (base_tokens / base_s),
    }
    print(f"without LoRA:            {base_tokens} tokens in {base_s:.2f}s = {result['base_tok_per_s']:.1f} tok/s")
    print(
        f"{args.adapters} adapters of rank {args.rank}: {lora_tokens} tokens in {lora_s:.2f}s = "
        f"{result['lora_tok_per_s']:.1f} tok/s"
    )
    print(f"ratio with / without LoRA: {result['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
