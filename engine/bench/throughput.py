"""`kiln bench throughput`: the same offline workload through kiln and through transformers.

N requests (default 256: more than the 64 seats) with prompt and output lengths drawn
from a fixed seed. kiln runs them with continuous batching; the baseline is transformers
`generate` with static, left-padded batches of the same size as kiln's max_num_seqs (each
batch runs until its longest output). Both count only the output tokens each request
asked for. Each side runs --repeats times, alternating, so a neighbour's load on a shared
machine falls on both; the fastest run of each is reported with the ratio, along with the
median ratio of the back-to-back pairs and the ratio per CPU second (the process's CPU time,
steadier than wall time when the cores are shared). With --constraint-regex, kiln also runs
the workload with every request constrained to that regex (structured outputs) and prints its
throughput as a ratio of the free run's.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import NamedTuple


def workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(5, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return reqs


class Run(NamedTuple):
    seconds: float  # wall time
    tokens: int  # output tokens the requests asked for
    cpu_seconds: float  # CPU time of this process (all its threads): steadier than wall time on a busy machine


def run_kiln(llm, reqs, regex: str | None = None) -> Run:
    from engine import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(regex=regex) if regex else None
    params = [
        SamplingParams(temperature=0, max_tokens=out, ignore_eos=True, detokenize=False, structured_outputs=constraint)
        for _, out in reqs
    ]
    # Every run starts with an empty prefix cache: repeats of the same prompts would otherwise skip
    # their prefill, which transformers has to redo (and a one-shot benchmark would not see).
    llm.reset_prefix_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run(elapsed, sum(len(o.outputs[0].token_ids) for o in outs), cpu)


def load_transformers(model_dir: str, device: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def run_transformers(model, reqs, batch_size: int, device: str) -> Run:
    import torch

    useful = 0
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i : i + batch_size]
            longest = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(batch):
                ids[row, longest - len(p) :] = torch.tensor(p)
                mask[row, longest - len(p) :] = 1
            new = max(out for _, out in batch)
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            useful += sum(out for _, out in batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return Run(time.perf_counter() - t0, useful, time.process_time() - c0)


def _seconds(runs: list[Run]) -> str:
    return ", ".join(f"{r.seconds:.3f}" for r in runs) + " s"


def _length_range(text: str) -> tuple[int, int]:
    parts = [int(x) for x in str(text).split(",")]
    return (parts[0], parts[-1])


def main(argv: list[str]) -> int:
    from engine.entrypoints.cli.flags import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser(prog="kiln bench throughput", description=__doc__, allow_abbrev=False)
    # Flag names shared with `kiln bench serve` (and vLLM's); the old names still work.
    parser.add_argument(
        "--num-prompts", "--num-requests", dest="num_requests", type=int, default=256, help="requests (default: 256)"
    )
    parser.add_argument(
        "--input-len",
        "--prompt-len",
        dest="prompt_len",
        default="16,256",
        help="prompt tokens: N, or MIN,MAX drawn uniformly (default: 16,256)",
    )
    parser.add_argument("--output-len", default="16,128", help="output tokens: N, or MIN,MAX (default: 16,128)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--baseline-batch-size", type=int, default=None, help="default: max_num_seqs")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each side, alternating (default: 3; the fastest is reported)",
    )
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument(
        "--constraint-regex", default=None, help="also run with every output constrained to this regex; print the cost"
    )
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    settings = settings_from_args(args)
    if settings.model is None:
        from engine.models.tiny_model import default_model_dir

        settings = settings.model_copy(update={"model": str(default_model_dir(settings.cache_dir))})
    if settings.tensor_parallel_size > 1:  # TP 1 against TP N in one run
        from engine.bench.tensor_parallel import main_tp

        return main_tp(args, settings, workload, _length_range, run_kiln)
    from engine.entrypoints.llm import LLM

    llm = LLM(**settings.model_dump(exclude_unset=True) | {"model": settings.model})
    lo, hi = _length_range(args.prompt_len)
    olo, ohi = _length_range(args.output_len)
    vocab = min(llm.engine.model_config.vocab_size, len(llm.tokenizer))
    reqs = workload(args.num_requests, (lo, hi), (olo, ohi), vocab, args.workload_seed)
    run_kiln(llm, reqs[: max(1, len(reqs) // 8)])  # warm-up (compilation, allocator)
    hf = None
    batch = args.baseline_batch_size or settings.max_num_seqs
    if not args.no_baseline:
        hf = load_transformers(settings.model, llm.engine.core.device.type, llm.engine.core.dtype)
        run_transformers(hf, reqs[:batch][: max(1, len(reqs) // 8)], batch, llm.engine.core.device.type)  # warm-up
    # Repeats alternate kiln and transformers, so a neighbour's load on a shared machine falls on
    # both; the fastest repeat of each is reported (the least disturbed), and the ratio of those.
    kiln_runs, hf_runs = [], []
    for _ in range(args.repeats):
        kiln_runs.append(run_kiln(llm, reqs))
        if hf is not None:
            hf_runs.append(run_transformers(hf, reqs, batch, llm.engine.core.device.type))
    kiln_s, kiln_tokens, _ = min(kiln_runs)
    kiln_cpu = min(r.cpu_seconds for r in kiln_runs)
    result = {
        "model": settings.model,
        "device": str(llm.engine.core.device),
        "dtype": str(llm.engine.core.dtype),
        "num_requests": len(reqs),
        "prompt_len": [lo, hi],
        "output_len": [olo, ohi],
        "repeats": args.repeats,
        "kiln_seconds": kiln_s,
        "kiln_output_tokens": kiln_tokens,
        "kiln_tok_per_s": kiln_tokens / kiln_s,
        "kiln_seconds_all": [r.seconds for r in kiln_runs],
        "kiln_cpu_seconds": kiln_cpu,
    }
    print(
        f"kiln:         {kiln_tokens} output tokens in {kiln_s:.3f}s = {kiln_tokens / kiln_s:.1f} tok/s"
        f" (fastest of {args.repeats}: {_seconds(kiln_runs)}; CPU time {kiln_cpu:.3f}s)"
    )
    if args.constraint_regex:
        run_kiln(llm, reqs[: max(1, len(reqs) // 8)], args.constraint_regex)
        so_s, so_tokens, _ = run_kiln(llm, reqs, args.constraint_regex)
        result.update(
            constrained_seconds=so_s,
            constrained_output_tokens=so_tokens,
            constrained_ratio=(so_tokens / so_s) / (kiln_tokens / kiln_s),
        )
        print(
            f"constrained:  {so_tokens} output tokens in {so_s:.2f}s = {so_tokens / so_s:.1f} tok/s "
            f"(regex {args.constraint_regex!r}); ratio constrained / free: {result['constrained_ratio']:.2f}x"
        )
    if hf is not None:
        hf_s, hf_tokens, _ = min(hf_runs)
        hf_cpu = min(r.cpu_seconds for r in hf_runs)
        pair_ratios = sorted((k.tokens / k.seconds) / (h.tokens / h.seconds) for k, h in zip(kiln_runs, hf_runs))
        result.update(
            hf_seconds=hf_s,
            hf_output_tokens=hf_tokens,
            hf_tok_per_s=hf_tokens / hf_s,
            hf_seconds_all=[r.seconds for r in hf_runs],
            hf_cpu_seconds=hf_cpu,
            hf_batch_size=batch,
            ratio=(kiln_tokens / kiln_s) / (hf_tokens / hf_s),
            median_pair_ratio=pair_ratios[len(pair_ratios) // 2],
            cpu_time_ratio=(kiln_tokens / kiln_cpu) / (hf_tokens / hf_cpu),
        )
        print(
            f"transformers: {hf_tokens} output tokens in {hf_s:.3f}s = {hf_tokens / hf_s:.1f} tok/s "
            f"(static batches of {batch}, left-padded; fastest of {args.repeats}: {_seconds(hf_runs)}; "
            f"CPU time {hf_cpu:.3f}s)"
        )
        print(
            f"ratio kiln / transformers: {result['ratio']:.2f}x "
            f"(median of the {args.repeats} back-to-back pairs: {result['median_pair_ratio']:.2f}x; "
            f"per CPU second: {result['cpu_time_ratio']:.2f}x)"
        )
    llm.engine.core.check_integrity()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
