"""`kiln bench spec`: speculative decoding against plain decoding, same model, same workload,
same run. Prints output tokens/s of each and the ratio, with the draft acceptance.

Two workloads:
  * default (no --model): n-gram prompt lookup on `make_periodic_model` (a tiny llama that
    repeats itself: the upper end of what prompt lookup gains), or `--random-model`, the
    embedded tiny model, which never repeats (the back-off's overhead); prompts of repeated text;
  * `--model DIR|FILE.gguf` with any of `--ngram`, `--draft-model DIR`, `--eagle DIR`,
    `--eagle3 DIR` (DIR `auto`: what `kiln make-draft-model` made for this target in kiln's
    cache): each method against plain decoding. `--chat-prompts` asks the built-in chat prompts
    (`kiln make-draft-model`'s test split: topics no draft was trained on; `--prompt-split train`:
    the topics its corpus was drawn from, in-domain) through the model's chat template. Engines
    are built once; the timed runs are interleaved (plain, method, plain, method, ...)
    `--repeats` times, so a machine whose load changes hurts every configuration alike; the
    figures are medians, and every method's greedy output is checked against plain decoding's
    (`same`).

The acceptance length is tokens per verify step: 1 + accepted drafts / verify steps (vLLM's
"mean acceptance length").
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _prompts(num: int, vocab: int) -> list[list[int]]:
    out = []
    for i in range(num):
        phrase = [(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(6)]
        out.append(phrase * 4 + phrase[:2])
    return out


def _timed(llm, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def _run(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    seconds, outs = _timed(llm, prompts, params)
    return seconds, sum(len(o) for o in outs)


def _spec_counts(llm) -> dict[str, float]:
    spec = llm.engine.core.scheduler.spec
    if spec is None:
        return {}
    steps = spec.num_drafts
    return {
        "draft_tokens": spec.num_draft_tokens,
        "accepted_tokens": spec.num_accepted_tokens,
        "verify_steps": steps,
        "acceptance": spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0,
        "acceptance_length": 1 + spec.num_accepted_tokens / steps if steps else 1.0,
        "drafts_per_step": spec.num_draft_tokens / steps if steps else 0.0,
        "accepted_per_pos": [a / steps if steps else 0.0 for a in spec.num_accepted_per_pos],
    }


def _methods(args, model: str, cache_dir: Path) -> dict[str, dict]:
    """name -> the speculative settings of each method asked for."""
    k = args.draft_tokens
    out = {}
    if args.ngram:
        out["ngram"] = dict(speculative_method="ngram", num_speculative_tokens=k)
    drafts = [("draft_model", flag) for flag in args.draft_model or []]
    for method, flag in drafts + [("eagle", args.eagle), ("eagle3", args.eagle3)]:
        if flag is None:
            continue
        path = cache_dir / "drafts" / f"{Path(model).stem}-{method}" if flag == "auto" else Path(flag)
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"kiln bench spec: no {method} draft at {path} (make one with `kiln make-draft-model "
                f"--target {model} --method {method}`)"
            )
        # (several draft models side by side: each row named after its directory)
        name = f"{method}:{path.name}" if method == "draft_model" and len(drafts) > 1 else method
        out[name] = dict(speculative_method=method, speculative_model=str(path), num_speculative_tokens=k)
    return out


def _compare(args, base: dict, model: str, settings) -> list[dict]:
    """Plain decoding and each method, interleaved repeats, batch = max_num_seqs."""
    from engine import SamplingParams
    from engine.entrypoints.cli.make_draft import chat_ids, chat_prompts
    from engine.entrypoints.llm import LLM

    methods = _methods(args, model, settings.cache_dir)
    if not methods:
        raise SystemExit("kiln bench spec --model: name a method (--ngram, --draft-model, --eagle, --eagle3)")
    batch = int(args.batch_sizes.split(",")[0])
    engines = {"plain": LLM(**base, max_num_seqs=batch)}
    for name, spec in methods.items():
        engines[name] = LLM(**base, max_num_seqs=batch, **spec)
    tok = engines["plain"].tokenizer
    if args.chat_prompts:
        prompts = [chat_ids(tok, p) for p in chat_prompts(args.prompt_split)][: args.num_prompts]
    else:
        prompts = _prompts(args.num_prompts, min(engines["plain"].engine.model_config.vocab_size, len(tok)))
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        detokenize=False,
        seed=0 if args.temperature > 0 else None,
    )
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:1], params, use_tqdm=False)
        if llm.engine.core.scheduler.spec is not None:  # (counters from the timed runs only)
            spec = llm.engine.core.scheduler.spec
            spec.num_draft_tokens = spec.num_drafts = spec.num_accepted_tokens = 0
            spec.num_accepted_per_pos = [0] * len(spec.num_accepted_per_pos)
            spec.num_drafts_per_pos = [0] * len(spec.num_drafts_per_pos)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            seconds, outs = _timed(llm, prompts, params)
            rates[name].append(sum(map(len, outs)) / seconds)
            outputs[name] = outs
    plain = statistics.median(rates["plain"])
    rows = [{"method": "plain", "tok_per_s": plain, "ratio": 1.0, "runs": rates["plain"]}]
    for name in methods:
        llm = engines[name]
        ratios = [r / p for r, p in zip(rates[name], rates["plain"])]
        rows.append(
            {
                "method": name,
                "tok_per_s": statistics.median(rates[name]),
                "ratio": statistics.median(ratios),
                "runs": rates[name],
                "same_as_plain": outputs[name] == outputs["plain"],
                **_spec_counts(llm),
            }
        )
        llm.engine.core.check_integrity()
    return rows


def main(argv: list[str]) -> int:
    from engine.entrypoints.cli.flags import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser(
        prog="kiln bench spec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,16", help="concurrent requests (max_num_seqs) per run")
    parser.add_argument("--requests-per-seat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--random-model", action="store_true", help="the embedded tiny model (never repeats)")
    parser.add_argument("--ngram", action="store_true", help="with --model: n-gram prompt lookup")
    parser.add_argument(
        "--draft-model",
        action="append",
        default=None,
        metavar="DIR",
        help="with --model: a draft model (or auto); repeat to compare several in the same run",
    )
    parser.add_argument("--eagle", default=None, metavar="DIR", help="with --model: an EAGLE head (or auto)")
    parser.add_argument("--eagle3", default=None, metavar="DIR", help="with --model: an EAGLE-3 head (or auto)")
    parser.add_argument(
        "--chat-prompts", action="store_true", help="with --model: chat prompts through the chat template"
    )
    parser.add_argument(
        "--prompt-split",
        choices=["test", "train"],
        default="test",
        help="with --chat-prompts: the topics no draft was trained on (test), or those its corpus "
        "was drawn from (train: in-domain, some of these very prompts answered in the corpus)",
    )
    parser.add_argument("--num-prompts", type=int, default=8, help="with --model: prompts per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="with --model: interleaved timed runs per engine")
    parser.add_argument("--temperature", type=float, default=0.0, help="with --model: sampling temperature")
    parser.add_argument("--ignore-eos", action="store_true", help="with --model: always max_tokens per answer")
    parser.add_argument("--json", default=None)
    add_settings_flags(
        parser,
        skip=(
            "max_num_seqs",
            "speculative_method",
            "num_speculative_tokens",
            "speculative_model",
            "speculative_config",
        ),
    )
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    if settings.model is not None:
        base = settings.model_dump(exclude_unset=True)
        rows = _compare(args, base, settings.model, settings)
        print(
            f"model {settings.model}, batch {args.batch_sizes.split(',')[0]}, up to {args.draft_tokens} draft tokens, "
            f"{args.max_tokens} output tokens, {args.num_prompts} "
            f"{f'chat ({args.prompt_split} split) ' if args.chat_prompts else ''}prompts, "
            f"{args.repeats} interleaved runs (median)"
        )
        width = max(12, *(len(r["method"]) for r in rows))
        print(
            f"{'method':>{width}} {'tok/s':>8} {'ratio':>7} {'accepted':>9} {'accept len':>11} {'drafts/step':>12} "
            f"{'same':>5}"
        )
        for r in rows:
            extra = (
                ""
                if r["method"] == "plain"
                else (
                    f"{r['acceptance']:>8.0%} {r['acceptance_length']:>11.2f} {r['drafts_per_step']:>12.2f} "
                    f"{'yes' if r['same_as_plain'] else 'NO':>5}  per position "
                    + " ".join(f"{a:.2f}" for a in r["accepted_per_pos"])
                )
            )
            print(f"{r['method']:>{width}} {r['tok_per_s']:>8.2f} {r['ratio']:>6.2f}x {extra}")
            print(f"{'':>{width}} runs (tok/s): " + " ".join(f"{x:.2f}" for x in r["runs"]))
        if args.json:
            Path(args.json).write_text(
                json.dumps({"model": settings.model, "args": vars(args), "rows": rows}, indent=2)
            )
        return 0
    return _ngram_periodic(args, settings)


def _ngram_periodic(args, settings) -> int:
    from engine.entrypoints.llm import LLM
    from engine.models.tiny_model import default_model_dir, make_periodic_model

    tmp = None
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
        sched = spec.engine.core.scheduler
        spec_s, spec_tokens = _run(spec, prompts, args.max_tokens)
        drafts, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
        spec.engine.core.check_integrity()
        row = {
            "batch": batch,
            "plain_tok_per_s": plain_tokens / plain_s,
            "spec_tok_per_s": spec_tokens / spec_s,
            "ratio": (spec_tokens / spec_s) / (plain_tokens / plain_s),
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "acceptance": accepted / drafts if drafts else 0.0,
            "tokens_per_verify": (accepted + drafts / args.draft_tokens) / (drafts / args.draft_tokens)
            if drafts
            else 0.0,
        }
        results.append(row)
        print(
            f"{batch:>5} {row['plain_tok_per_s']:>12.1f} {row['spec_tok_per_s']:>11.1f} {row['ratio']:>6.2f}x "
            f"{row['acceptance']:>8.0%} {row['tokens_per_verify']:>14.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": model, "draft_tokens": args.draft_tokens, "rows": results}, indent=2)
        )
    if tmp is not None:
        tmp.cleanup()
    return 0
