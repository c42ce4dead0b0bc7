"""`kiln bench latency`: milliseconds per decode step for one batch, against transformers.

    kiln bench latency --preset llama-3.1-8b --batch-size 1,64 --input-len 128 --output-len 128 --baseline
    kiln bench latency --model DIR --batch-size 8 --input-len 32 --output-len 16 --json out.json
    kiln bench latency --preset smollm2-135m --context-depth 0,4k,16k,32k --output-len 32

--context-depth: decode and prefill tokens per second at batch 1 and each depth, against a
float32-KV baseline in the same run (engine/bench/long_context.py).

B requests of I random prompt tokens each generate exactly O tokens (greedy, ignore_eos,
no detokenisation), driven step by step through LLMEngine as serving drives it: nothing
synchronises the device between steps, so with overlap scheduling (a GPU's default) the host
prepares step N+1 while the device runs step N. The decode window runs from the step() call that
processed the last prompt token to the end of the run, the device synchronised at its end; its
seconds over the steps processed in it are `ms_per_step` (the figure), its tokens over its
seconds `decode_tok_per_s`. The host interval between successive step() returns inside the
window is kept per step (`step_ms_median`, `step_ms_p99`: secondary; in the overlapped steady
state a call returns when the previous step's tokens are on the host). Also reported: the
weight bytes read per step (all parameters once, the DESIGN.md convention) over `ms_per_step`
as GB/s, and that as a share of a device-to-device copy bandwidth measured in the same run
(bytes read + written), and what produced the figure (device, backend, CUDA graphs, overlap).
With --json the rows are written once the engine is built (each with `status` "pending" and the
start-up, compile and capture seconds) and each again as soon as it is measured ("done"; a batch
that fails leaves "error" and its message, one cut off "running"), so a run that fails or is cut
off keeps what it measured. `--wait-for PATH` builds the engine, then waits until PATH exists
before measuring anything (tools/gpu_check.sh builds engines while other stages run and times
them on a quiet GPU).
`--preset` writes a config-only model directory to a temporary directory and loads random
weights (load_format=dummy) directly on the device.

`--baseline` runs transformers `generate` (eager, sdpa attention) on the same weights in
the same process: its model is built from the same config.json with random init on the
device and kiln's weights are copied into it (q/k/v and gate/up un-fused), so both
compare one model. Same batch, prompts and output length (min_new_tokens = max_new_tokens),
total generate time divided by the output length gives its ms per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.config.process_setup import prepare_process

# An entry point (`python -m engine.bench.latency`, as tools/gpu_check.sh runs it): before torch loads.
prepare_process()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from compiler.compilation.capture import compile_count  # noqa: E402
from engine.bench.hf_baseline import build_hf_model, run_hf  # noqa: E402
from engine.bench.memory_report import memory_report, reset_peak_rss, weight_bytes  # noqa: E402

PRESETS = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "smollm2-135m")


# ---- helpers --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (eager copies)."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * iters / seconds / 1e9


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(5, vocab, size=(batch, length)).tolist()


# ---- kiln ------------------------------------------------------------------------------------
def run_kiln(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    """Generate for `prompts`; time the decode window (see the module's docstring)."""
    from engine.core.params import SamplingParams

    device = engine.core.device
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    tokens: dict[str, list[int]] = {}
    # A request's prompt is processed when its first token comes out (counting prompt tokens would
    # miss the ones a prefix-cache hit skips: a prompt seen before never opened the window).
    started: set[str] = set()
    window_start = window_tokens = None
    returns: list[float] = []  # host time of each step() return inside the window
    runner = engine.core.runner
    graphs = runner.graph_runner
    replays0 = compiles0 = forwards0 = 0  # at the window's start: what the window ran, replayed, compiled
    _sync(device)
    t_start = time.perf_counter()
    while engine.core.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
        if window_start is not None:
            returns.append(now)
        elif len(started) == len(prompts):  # every prompt token is processed
            window_start, window_tokens = now, engine.core.num_generation_tokens_total
            replays0, compiles0 = (graphs.num_replays if graphs else 0), compile_count()
            forwards0 = runner.num_forwards
    _sync(device)
    t_end = time.perf_counter()
    engine.core.check_integrity()
    res = {
        "total_s": t_end - t_start,
        "tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))],
        "decode_steps": len(returns),
        "window_s": 0.0,
        "window_tokens": 0,
        "step_s": [],
    }
    if returns:
        res.update(
            window_s=t_end - window_start,
            window_tokens=engine.core.num_generation_tokens_total - window_tokens,
            step_s=np.diff([window_start] + returns).tolist(),
            forwards=runner.num_forwards - forwards0,
            graph_replays=graphs.num_replays - replays0 if graphs else None,
            recompiles=compile_count() - compiles0,
        )
    return res


def bench_one(engine, batch: int, input_len: int, output_len: int, args, copy_gbps: float, hf=None) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(batch, input_len, vocab, args.prompt_seed + batch)
    graphs = engine.core.runner.graph_runner
    if graphs is not None:  # capture now any context bucket the run will need (not mid-measurement)
        graphs.ensure(batch, input_len + output_len)
    run_kiln(engine, random_prompts(batch, input_len, vocab, args.prompt_seed + 7919), args.warmup_steps, "warm")
    res = run_kiln(engine, prompts, output_len, "lat")
    if res["decode_steps"] == 0:
        raise RuntimeError("no decode steps were timed (output_len must be at least 2)")
    ms = res["window_s"] / res["decode_steps"] * 1e3
    steps = np.array(res["step_s"]) * 1e3
    wbytes = weight_bytes(engine.core.model)
    gbps = wbytes / (ms / 1e3) / 1e9
    row: dict[str, Any] = {
        "batch_size": batch,
        "input_len": input_len,
        "output_len": output_len,
        "ms_per_step": ms,
        "decode_tok_per_s": res["window_tokens"] / res["window_s"],
        "step_ms_median": float(np.median(steps)),
        "step_ms_p99": float(np.percentile(steps, 99)),
        "e2e_tok_per_s": batch * output_len / res["total_s"],
        "weight_GBps": gbps,
        "copy_GBps": copy_gbps,
        "bandwidth_share": gbps / copy_gbps,
        "decode_steps": res["decode_steps"],
        "decode_window_s": res["window_s"],
        "weight_GB": wbytes / 1e9,
        # What the timed window ran, replayed and compiled: a figure stands for graph replay only
        # when every forward in it replayed a graph and nothing compiled (tools/gpu_summary.py checks).
        "forwards": res.get("forwards"),
        "graph_replays": res.get("graph_replays"),
        "recompiles": res.get("recompiles"),
    }
    print(
        f"  batch {batch}: {ms:.3f} ms per decode step over {res['decode_steps']} steps timed together "
        f"(per step: median {row['step_ms_median']:.3f} ms, p99 {row['step_ms_p99']:.3f} ms); "
        f"{row['decode_tok_per_s']:.1f} tok/s decoding, {row['e2e_tok_per_s']:.1f} tok/s end to end (with prefill)"
    )
    print(
        f"           weights {wbytes / 1e9:.3f} GB per step -> {gbps:.1f} GB/s = "
        f"{100 * gbps / copy_gbps:.1f}% of the copy bandwidth ({copy_gbps:.0f} GB/s measured)"
    )
    if hf is not None:
        out_len = min(output_len, args.baseline_max_output_len)
        hf_s, hf_tokens = run_hf(hf, prompts, out_len, engine.core.device)
        hf_ms = hf_s / out_len * 1e3
        hf_tps = batch * out_len / hf_s
        same_first = sum(a[:1] == b[:1] for a, b in zip(res["tokens"], hf_tokens)) / batch
        row.update(
            hf_ms_per_step=hf_ms,
            hf_tok_per_s=hf_tps,
            hf_output_len=out_len,
            speedup_per_step=hf_ms / ms,
            speedup_tok_per_s=row["e2e_tok_per_s"] / hf_tps,
            first_token_agreement=same_first,
        )
        print(
            f"           transformers generate (eager, sdpa), output {out_len}: {hf_ms:.3f} ms/step, "
            f"{hf_tps:.1f} tok/s -> kiln {row['speedup_per_step']:.2f}x per decode step, "
            f"{row['speedup_tok_per_s']:.2f}x tokens/s end to end; first tokens equal in "
            f"{100 * same_first:.0f}% of rows"
        )
    return row


# ---- entry point ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from engine.entrypoints.cli.flags import add_settings_flags

    parser = argparse.ArgumentParser(
        prog="kiln bench latency",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch-size", default="1", help="B, or B1,B2,... (one engine, run in turn)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="a real-size config with random weights (instead of --model DIR)",
    )
    parser.add_argument("--warmup-steps", type=int, default=8, help="output tokens of the warm-up run")
    parser.add_argument(
        "--context-depth",
        default=None,
        help="depths like 0,4k,16k,32k: batch-1 decode and prefill at each, against a float32-KV baseline "
        "(engine/bench/long_context.py; --batch-size and --input-len do not apply)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--context-depth: interleaved rounds (medians)")
    parser.add_argument("--baseline", action="store_true", help="also run transformers generate")
    parser.add_argument(
        "--baseline-max-output-len",
        type=int,
        default=128,
        help="cap on the baseline's output length (eager transformers is slow)",
    )
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--wait-for",
        default=None,
        metavar="PATH",
        help="after start-up, wait until PATH exists before measuring (a quiet device)",
    )
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="only build the engine and report weight memory (against bf16) and peak RSS",
    )
    add_settings_flags(parser)
    return parser


def main(argv: list[str]) -> int:
    from engine.entrypoints.cli.flags import settings_from_args
    from engine.runtime.llm_engine import LLMEngine

    args = build_parser().parse_args(argv)
    batches = sorted({int(b) for b in str(args.batch_size).split(",") if b.strip()})
    if not batches or batches[0] < 1 or args.input_len < 1 or args.output_len < 2:
        print("kiln bench latency: need batch sizes >= 1, --input-len >= 1, --output-len >= 2", file=sys.stderr)
        return 2
    explicit = {k.removeprefix("setting__") for k in vars(args) if k.startswith("setting__")}
    depths = None
    if args.context_depth is not None:
        from engine.bench import long_context

        try:
            depths = long_context.parse_depths(args.context_depth)
        except ValueError as e:
            print(f"kiln bench latency: {e}", file=sys.stderr)
            return 2
    tmp = None
    extra: dict[str, Any] = {}
    if args.preset is not None:
        if "model" in explicit:
            print("kiln bench latency: give --preset or --model, not both", file=sys.stderr)
            return 2
        from engine.models.tiny_model import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="kiln-latency-")
        # (--context-depth: the preset's context stretched to the deepest depth, for speed only)
        longer = {} if depths is None else {"max_position_embeddings": max(32768, max(depths) + args.output_len + 1)}
        extra["model"] = str(
            make_tiny_model(Path(tmp.name) / args.preset, preset=args.preset, config_only=True, overrides=longer)
        )
        if "load_format" not in explicit:
            extra["load_format"] = "dummy"
    settings = settings_from_args(args, **extra)
    if depths is not None:
        try:
            return long_context.run(settings, depths, args.output_len, args.rounds, args.json)
        finally:
            if tmp is not None:
                tmp.cleanup()
    # Size the engine for this benchmark unless told otherwise: KV for the largest batch only
    # (leaves the GPU memory to the baseline), max_model_len = input + output.
    need_len = args.input_len + args.output_len
    defaults: dict[str, Any] = {}
    if "max_model_len" not in explicit:
        defaults["max_model_len"] = need_len
    if "max_num_seqs" not in explicit and settings.max_num_seqs < batches[-1]:
        defaults["max_num_seqs"] = batches[-1]
    if "num_gpu_blocks" not in explicit:
        bs = settings.block_size
        defaults["num_gpu_blocks"] = batches[-1] * (-(-need_len // bs) + 1) + 16
    if defaults:
        settings = settings.model_copy(update=defaults)
        settings = type(settings)(**settings.model_dump(exclude_unset=False))  # re-validate
    if settings.max_num_seqs < batches[-1]:
        print(f"kiln bench latency: max_num_seqs ({settings.max_num_seqs}) < batch size {batches[-1]}", file=sys.stderr)
        return 2

    rss_before = reset_peak_rss()
    t0 = time.perf_counter()
    engine = LLMEngine.from_settings(settings)
    startup = time.perf_counter() - t0
    name = args.preset or str(engine.model_dir)
    if args.load_only:
        row = memory_report(engine, name, rss_before, startup)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=2))
        if tmp is not None:
            tmp.cleanup()
        return 0
    produced_by = {
        "model": name,
        "device": str(engine.core.device),
        "dtype": str(engine.core.dtype).removeprefix("torch."),
        "backend": engine.core.backend.name,
        "cuda_graphs": engine.core.runner.graph_runner is not None,
        "async_scheduling": engine.core.async_scheduling,
        "enforce_eager": settings.enforce_eager,
        "decode_kernel": settings.decode_kernel,
        "prefill_kernel": settings.prefill_kernel,
        "quantization": settings.quantization,
    }
    print(
        f"kiln bench latency: {name} ({produced_by['dtype']}, {engine.core.device}, "
        f"attention {engine.core.backend.name}, "
        f"{'eager' if settings.enforce_eager else 'compiled'}"
        f"{', CUDA graphs' if produced_by['cuda_graphs'] else ''}, overlap scheduling "
        f"{'on' if engine.core.async_scheduling else 'off'}), input {args.input_len}, output {args.output_len}"
    )
    print(
        f"  start-up {startup:.1f}s (compile {engine.core.compile_seconds:.1f}s, "
        f"capture {engine.core.capture_seconds:.1f}s)"
    )
    started = dict(startup_s=startup, compile_s=engine.core.compile_seconds, capture_s=engine.core.capture_seconds)
    rows = [dict(produced_by, batch_size=b, status="pending", **started) for b in batches]

    def write() -> None:
        if args.json:
            write_rows(Path(args.json), rows, single=len(batches) == 1)

    write()
    if args.wait_for:
        print(f"  waiting for {args.wait_for} before measuring", flush=True)
        t_wait = time.perf_counter()
        while not Path(args.wait_for).exists():
            time.sleep(0.1)
        print(f"  waited {time.perf_counter() - t_wait:.1f}s", flush=True)
    copy_gbps = copy_bandwidth(engine.core.device)
    hf = build_hf_model(engine) if args.baseline else None
    failed = None
    for row in rows:
        row["status"] = "running"
        write()
        try:
            row.update(bench_one(engine, row["batch_size"], args.input_len, args.output_len, args, copy_gbps, hf))
            row["status"] = "done"
        except Exception as e:  # noqa: BLE001 - recorded in the row, the earlier rows stay
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
            failed = e
        write()
        if failed is not None:
            break
    if tmp is not None:
        tmp.cleanup()
    if failed is not None:
        raise failed
    return 0


# The summary keys first (tools/gpu_summary.py and a reader of the JSON see the figures first).
ROW_ORDER = [
    "batch_size",
    "status",
    "ms_per_step",
    "decode_tok_per_s",
    "step_ms_median",
    "step_ms_p99",
    "e2e_tok_per_s",
    "weight_GBps",
    "bandwidth_share",
    "backend",
    "cuda_graphs",
    "async_scheduling",
    "hf_ms_per_step",
    "hf_tok_per_s",
    "speedup_per_step",
    "speedup_tok_per_s",
    "startup_s",
    "compile_s",
    "capture_s",
]


def write_rows(path: Path, rows: list[dict[str, Any]], single: bool) -> None:
    """The rows so far (one row alone when a single batch size was asked for), replaced atomically."""
    rows = [{**{k: r[k] for k in ROW_ORDER if k in r}, **r} for r in rows]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows[0] if single else rows, indent=2))
    tmp.replace(path)


if __name__ == "__main__":
    # as `kiln bench latency` logs: the start-up phases with their seconds (weights, KV, compile, capture)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
