"""TTFT of a returning long prefix with the KV tiers off and on: after the prefix is evicted from
the KV cache, and after a restart (a new engine on the same disk directory).

Runs, one engine at a time, on one prompt of --tokens random token ids (max_tokens=1, greedy):
  off       an engine without tiers: the prompt computed (what every return costs without tiers)
  on/cold   an engine with the disk tier (and host tier with --host-gb): the first time, prefill
            plus the write-behind of its blocks (the price of having tiers on)
  on/evicted  the same engine after reset_prefix_cache() (every idle block evicted): a load
  restart   a new engine on the same directory: its index rebuilt, the prefix loaded
and checks that the first token is the same in every run. Prints each TTFT and off / on ratios.

With --llama-cpp-dir (llama.cpp's binaries) and --model a GGUF file, llama-server runs the same
prompt through its own answer, slot files saved and restored across a restart
(tools/kv_tiers_llamacpp.py), and a table sets the two side by side.

    PYTHONPATH=$PWD python tools/bench_kv_tiers.py --preset llama-3.2-1b --tokens 4096
    PYTHONPATH=$PWD python tools/bench_kv_tiers.py --model /path/to/model.gguf --tokens 2048
    PYTHONPATH=$PWD python tools/bench_kv_tiers.py --model m.gguf --dtype float32 --llama-cpp-dir LLAMA_CPP/build/bin

--preset makes a real-size config with random weights (load_format=dummy): the prefill costs what
the real model's does; no hub is needed.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from pathlib import Path


def ttft(llm, prompt: list[int]) -> tuple[float, int, int]:
    from engine.core.params import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0], out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint directory or GGUF file")
    ap.add_argument("--preset", default="llama-3.2-1b", help="a real-size config with random weights (no --model)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dir", help="the disk tier's directory (default: a new temporary one)")
    ap.add_argument("--host-gb", type=float, default=None, help="also a host tier of this many GiB")
    ap.add_argument(
        "--cpu-quant-activations",
        default=None,
        help="as the setting (a quantised model's int8 activations make a prefix-cache hit's last chunk differ "
        "from a one-shot prefill's; float keeps them equal)",
    )
    ap.add_argument("--llama-cpp-dir", help="llama.cpp's binaries: also llama-server's slot files (a GGUF --model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    ap.add_argument("--port", type=int, default=8031, help="llama-server's port")
    args = ap.parse_args()
    if args.llama_cpp_dir and not (args.model or "").endswith(".gguf"):
        ap.error("--llama-cpp-dir needs --model naming a .gguf file (the same weights for both)")

    from engine.entrypoints.llm import LLM

    work = Path(tempfile.mkdtemp(prefix="kiln-kv-tiers-bench-"))
    settings: dict = dict(
        device="cpu", dtype=args.dtype, max_model_len=args.tokens + 64, kv_cache_memory_gb=1.0, max_num_seqs=1
    )
    if args.cpu_quant_activations:
        settings["cpu_quant_activations"] = args.cpu_quant_activations
    if args.model:
        model = args.model
    else:
        from engine.models.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "model", preset=args.preset, config_only=True))
        settings["load_format"] = "dummy"
    tiers = dict(kv_disk_path=args.kv_dir or str(work / "kv"))
    if args.host_gb:
        tiers["kv_offloading_size"] = args.host_gb
    rng = random.Random(0)

    def engine(**extra):
        t0 = time.perf_counter()
        llm = LLM(model, **settings, **extra)
        start = time.perf_counter() - t0
        ttft(llm, [rng.randrange(10, 1000) for _ in range(32)])  # (first-call costs out of the timings)
        return llm, start

    llm, _ = engine()
    vocab = llm.engine.model_config.vocab_size
    prompt = [rng.randrange(10, min(vocab, 32000)) for _ in range(args.tokens)]
    rows: dict[str, float] = {}
    off, tok_off, _ = ttft(llm, prompt)
    print(f"off          TTFT {off:8.2f} s  (recompute)")
    del llm
    gc.collect()

    llm, _ = engine(**tiers)
    cold, tok_cold, _ = ttft(llm, prompt)
    t0 = time.perf_counter()
    llm.engine.core.kv_tiers.flush()
    flushed = time.perf_counter() - t0
    print(f"on/cold      TTFT {cold:8.2f} s  (prefill; writing its blocks took {flushed:.2f} s more, behind)")
    pool_hit, tok_pool, _ = ttft(llm, prompt)
    print(f"pool hit     TTFT {pool_hit:8.2f} s  (the prefix still in the KV cache: the floor)")
    llm.reset_prefix_cache()
    evicted, tok_ev, cached_ev = ttft(llm, prompt)
    print(f"on/evicted   TTFT {evicted:8.2f} s  ({cached_ev} of {args.tokens} tokens loaded)")
    llm.close()
    del llm
    gc.collect()

    llm, start = engine(**tiers)
    restart, tok_re, cached_re = ttft(llm, prompt)
    print(f"restart      TTFT {restart:8.2f} s  ({cached_re} tokens loaded; engine start {start:.1f} s)")
    stats = {t.name: t.stats for t in llm.engine.core.kv_tiers.store.tiers}
    print("tier stats after the restart run:", stats)
    llm.close()
    # A tier hit must equal a prefix-cache hit in the pool: the same cached KV. (Against a full
    # recompute, a bf16 model's last-chunk numerics may differ from a one-shot prefill's, as with any
    # prefix-cache hit; in float32 all agree.)
    same = tok_pool == tok_ev == tok_re
    print(f"first token: recompute {tok_off} / {tok_cold}, pool hit {tok_pool}, evicted {tok_ev}, restart {tok_re}")
    print(f"tier hits equal the pool's prefix-cache hit: {same}; equal to recompute: {tok_off == tok_ev == tok_re}")
    print(f"ratio off / on after eviction: {off / evicted:.1f}x;  off / on after a restart: {off / restart:.1f}x")
    print(f"tiers-on cold vs off: {cold / off:.3f} (1.0 = no cost)")
    rows.update({"off": off, "on/cold": cold, "pool hit": pool_hit, "on/evicted": evicted, "restart": restart})
    if args.llama_cpp_dir:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tools/ as a package, run as a script)
        from tools.kv_tiers_llamacpp import run_llama_server

        peer = run_llama_server(Path(args.llama_cpp_dir), args.model, prompt, args.threads, args.port)
        print(f"\n{'TTFT, s':<12}{'kiln':>9}{'llama-server':>14}{'ratio':>8}  ({args.tokens} tokens)")
        for key in ("off", "on/cold", "pool hit", "restart"):
            theirs = peer[key] + (peer["restore"] if key == "restart" else 0.0)
            print(f"{key:<12}{rows[key]:>9.2f}{theirs:>14.2f}{theirs / rows[key]:>7.2f}x")
        print("(llama-server's restart row: its slot restore call plus the request; ratio > 1: kiln faster)")
    if not same:
        raise SystemExit("tokens differ")


if __name__ == "__main__":
    main()
