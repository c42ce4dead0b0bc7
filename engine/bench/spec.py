"""`kiln bench spec`: n-gram speculative decoding against plain decoding, same model, same
workload, same run. Prints output tokens/s of both and the ratio, with the draft acceptance rate.

The default model is `make_periodic_model` (a tiny llama that repeats itself: the upper end of
what prompt lookup gains); `--model DIR` benchmarks a real checkpoint, and `--random-model`
the embedded tiny model, which never repeats (the back-off's overhead: the ratio should stay
near 1). Greedy, ignore_eos, prompts with repeated text.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _prompts(num: int, vocab: int) -> list[list[int]]:
    out = []
    for i in range(num):
        phrase = [(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(6)]
        out.append(phrase * 4 + phrase[:2])
    return out


def _run(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str]) -> int:
    from engine.entrypoints.cli.flags import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser(prog="kiln bench spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16", help="concurrent requests (max_num_seqs) per run")
    parser.add_argument("--requests-per-seat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--random-model", action="store_true", help="the embedded tiny model (never repeats)")
    parser.add_argument("--json", default=None)
    add_settings_flags(parser, skip=("max_num_seqs", "speculative_method", "num_speculative_tokens"))
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    from engine.entrypoints.llm import LLM
    from engine.models.tiny_model import default_model_dir, make_periodic_model

    tmp = None
    model = settings.model
    if model is None:
        if args.random_model:
            model = str(default_model_dir(settings.cache_dir))
        else:
            tmp = tempfile.TemporaryDirectory()
            model = str(make_periodic_model(Path(tmp.name) / "periodic"))
    base = settings.model_dump(exclude_unset=True) | {"model": model}
    results = []
    print(f"model {model}, {args.draft_tokens} draft tokens, {args.max_tokens} output tokens per request")
    print(f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7} {'accepted':>9} {'tokens/verify':>14}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        plain = LLM(**base, max_num_seqs=batch)
        vocab = min(plain.engine.model_config.vocab_size, len(plain.tokenizer))
        prompts = _prompts(batch * args.requests_per_seat, vocab)
        plain_s, plain_tokens = _run(plain, prompts, args.max_tokens)
        del plain
        spec = LLM(**base, max_num_seqs=batch, speculative_method="ngram", num_speculative_tokens=args.draft_tokens)
        sched = spec.engine.scheduler
        spec_s, spec_tokens = _run(spec, prompts, args.max_tokens)
        drafts, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
        spec.engine.check_integrity()
        row = {"batch": batch, "plain_tok_per_s": plain_tokens / plain_s, "spec_tok_per_s": spec_tokens / spec_s,
               "ratio": (spec_tokens / spec_s) / (plain_tokens / plain_s), "draft_tokens": drafts,
               "accepted_tokens": accepted, "acceptance": accepted / drafts if drafts else 0.0,
               "tokens_per_verify": (accepted + drafts / args.draft_tokens) / (drafts / args.draft_tokens)
               if drafts else 0.0}
        results.append(row)
        print(f"{batch:>5} {row['plain_tok_per_s']:>12.1f} {row['spec_tok_per_s']:>11.1f} {row['ratio']:>6.2f}x "
              f"{row['acceptance']:>8.0%} {row['tokens_per_verify']:>14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "draft_tokens": args.draft_tokens, "rows": results},
                                              indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0
