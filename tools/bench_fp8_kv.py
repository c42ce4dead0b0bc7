"""FP8 KV cache benchmark (CPU): KV blocks at a fixed budget and decode throughput, fp8 vs auto.

    PYTHONPATH=. python tools/bench_fp8_kv.py [--budget-gb 0.05] [--batch 16] [--prompt-len 200] \
        [--new-tokens 64] [--rounds 3] [--no-speed] [--trained [--train-steps 500]] [--smollm2 FILE]

1. Blocks: engines built on the tiny llama at the same kv_cache_memory_gb with model dtype fp32
   and bf16, kv_cache_dtype auto and fp8; prints the block counts and the ratios (fp8 / auto).
   Also the Llama-3.1-8B shape's bytes per block (kv_sizing only, no engine).
2. Decode throughput: the tiny llama (fp32 model, compiled CPU decode attention), `batch`
   prompts of `prompt_len` random tokens, `new_tokens` greedy tokens each; auto and fp8
   alternate for `rounds` rounds (the machine may be shared: the ratio of medians measured in
   the same run is the figure).
3. The decode attention op alone (compiler/kernels/cpu_attention.py, compiled ahead of time) and write_kv,
   fp32 cache vs fp8 cache, batch 16 x 1024 context, 8 query / 2 KV heads of 64, alternated.
4. With --trained: the fidelity gate's figures (tests/layers/test_fp8_kv.py) on tiny llama and qwen3
   models trained `--train-steps` steps on the tokenizer's corpus: greedy token agreement and
   logprob drift of the fp8 cache (scales 1.0, calibrated) against the model-dtype cache, for a
   bf16 and an fp32 model, over the gate's 20 prompts and over 10 prompts that never meet the
   corpus; the bf16 model against the fp32 one for scale; and broken caches that the gate must
   reject (read back x16, K and V swapped, V zeroed) or that it cannot see (a truncating
   quantiser, a subtle error).
5. With --smollm2 FILE (SmolLM2-135M-Instruct.Q4_1.gguf, tests/support/real_model.py fetches it): the
   agreement of a real model's fp8 cache (scales 1.0, calibrated) and of its bf16 model with its fp32
   cache: position-wise (20 English sentences, the last 32 positions of each scored with prompt
   logprobs: same top-1 token, |logprob drift| of the actual next token) and greedy (20 prompts x
   32 tokens). Slow on a CPU (minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _blocks(model: Path, budget: float) -> None:
    from engine.entrypoints.llm import LLM

    print(f"KV blocks at kv_cache_memory_gb={budget} (tiny llama, CPU):")
    for dtype in ("float32", "bfloat16"):
        counts = {}
        for kv in ("auto", "fp8"):
            llm = LLM(
                str(model),
                device="cpu",
                enforce_eager=True,
                dtype=dtype,
                kv_cache_dtype=kv,
                kv_cache_memory_gb=budget,
                max_model_len=256,
            )
            counts[kv] = llm.engine.core.kv_cache.num_blocks
            del llm
        print(
            f"  model {dtype:9s}: auto {counts['auto']:6d} blocks, fp8 {counts['fp8']:6d} blocks, "
            f"ratio {counts['fp8'] / counts['auto']:.3f}"
        )
    from engine.layers.kv_cache import KVCache

    per = {
        n: KVCache.bytes_per_block(32, 16, 8, 128, d)
        for n, d in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn))
    }
    gib = 40 * (1 << 30)
    print(
        f"  Llama-3.1-8B shape, block 16: {per['bf16']} bytes/block bf16, {per['fp8']} fp8; in 40 GiB: "
        f"{gib // per['bf16']} vs {gib // per['fp8']} blocks ({gib // per['bf16'] * 16} vs "
        f"{gib // per['fp8'] * 16} tokens)"
    )


def _throughput(model: Path, batch: int, prompt_len: int, new_tokens: int, rounds: int) -> None:
    from engine.core.params import SamplingParams
    from engine.entrypoints.llm import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    engines = {
        kv: LLM(
            str(model), device="cpu", kv_cache_dtype=kv, max_num_seqs=batch, max_model_len=1024, kv_cache_memory_gb=0.2
        )
        for kv in ("auto", "fp8")
    }
    for llm in engines.values():  # warm-up (compiles nothing new; loads the decode kernels)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates: dict[str, list[float]] = {kv: [] for kv in engines}
    for _ in range(rounds):
        for kv, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates[kv].append(batch * new_tokens / (time.perf_counter() - t0))
    med = {kv: statistics.median(r) for kv, r in rates.items()}
    print(
        f"CPU decode throughput, tiny llama fp32, batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, "
        f"{rounds} rounds (median tok/s; prefill included):"
    )
    for kv in engines:
        print(f"  {kv:4s}: {med[kv]:8.1f} tok/s  (rounds: {', '.join(f'{r:.1f}' for r in rates[kv])})")
    print(f"  ratio fp8 / auto: {med['fp8'] / med['auto']:.3f}")


TEXTS = [
    "The capital of France is Paris, a city known for the Eiffel Tower, its museums such as the Louvre,"
    " and the river Seine that runs through its centre.",
    "Water boils at one hundred degrees Celsius at sea level, but at higher altitudes the air pressure"
    " is lower, so it boils at a lower temperature.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make"
    " glucose and release oxygen into the air.",
    "The human heart has four chambers: two atria that receive blood and two ventricles that pump it out"
    " to the lungs and to the rest of the body.",
    "Mount Everest, on the border between Nepal and China, is the highest mountain on Earth, rising"
    " almost nine thousand metres above sea level.",
    "In Python, a list comprehension builds a new list by applying an expression to each item of an"
    " iterable, optionally filtered by a condition.",
    "The French Revolution began in 1789 and led to the end of the monarchy, the rise of Napoleon, and"
    " lasting changes in European politics.",
    "Honey bees live in colonies with a single queen, thousands of female workers and a few hundred male"
    " drones that mate with new queens.",
    "Electric cars use a battery to power an electric motor, which makes them quieter than petrol cars"
    " and produces no exhaust from the car.",
    "The Moon orbits the Earth about once every twenty seven days, and its gravity causes the tides that"
    " rise and fall along our coasts.",
    "A good breakfast often includes some protein, such as eggs or yoghurt, some fruit, and whole grains"
    " like oats or wholemeal bread.",
    "The internet is a global network of computers that exchange data using shared protocols, the most"
    " important being TCP and IP.",
    "Climate change refers to long term shifts in temperatures and weather patterns, mainly caused by"
    " burning fossil fuels since the 1800s.",
    "The piano is a keyboard instrument in which hammers strike strings when keys are pressed; it can"
    " play both very softly and very loudly.",
    "Football, known as soccer in some countries, is played by two teams of eleven players who try to"
    " kick a ball into the other team's goal.",
    "Machine learning is a field of computer science in which programs improve at a task by learning"
    " patterns from data rather than rules.",
    "Coffee is brewed from roasted coffee beans; it contains caffeine, which is a stimulant that helps"
    " many people feel more awake.",
    "The Roman Empire was one of the largest empires of the ancient world, with Rome as its capital and"
    " Latin as its main language.",
    "On a rainy day, many people like to stay inside, read a book, drink a warm cup of tea and listen to"
    " the sound of rain on the window.",
    "The ocean covers about seventy percent of the Earth's surface and contains most of the planet's"
    " water, as well as countless species.",
]


def _attention_op(rounds: int = 30) -> None:
    from compiler.kernels.cpu_attention import paged_attention_cpu_impl
    from compiler.kernels.reference_attention import write_kv_reference

    torch.manual_seed(0)
    seqs, ctx, hq, hkv, d, bs = 16, 1024, 8, 2, 64, 16
    blocks = seqs * ctx // bs + 1
    tables = (torch.arange(seqs * ctx // bs, dtype=torch.int32) + 1).view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    q = torch.randn(seqs, hq, d)
    k, v = torch.randn(seqs, hkv, d), torch.randn(seqs, hkv, d)
    slots = tables[:, -1].long() * bs + bs - 1
    caches = {}
    for name, dtype in (("fp32", torch.float32), ("fp8", torch.float8_e4m3fn)):
        c = torch.zeros(1, 2, blocks, bs, hkv, d, dtype=dtype)
        c[0, 0], c[0, 1] = torch.randn(blocks, bs, hkv, d).to(dtype), torch.randn(blocks, bs, hkv, d).to(dtype)
        caches[name] = c
    scales = torch.tensor([[0.01, 0.02]])
    times: dict[str, list[float]] = {f"{op} {n}": [] for op in ("attention", "write_kv") for n in caches}
    out = torch.empty_like(q)
    for i in range(rounds + 2):
        for name, c in caches.items():
            sc = scales if name == "fp8" else None
            t0 = time.perf_counter()
            paged_attention_cpu_impl(out, q, c, 0, qsl, lens, tables, 0.125, 1, ctx, seqs, sc)
            t1 = time.perf_counter()
            write_kv_reference(k, v, c[0, 0], c[0, 1], slots, *((sc[0, 0], sc[0, 1]) if sc is not None else ()))
            t2 = time.perf_counter()
            if i >= 2:  # the first rounds load the kernels
                times[f"attention {name}"].append(t1 - t0)
                times[f"write_kv {name}"].append(t2 - t1)
    med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    print(
        f"CPU decode attention op, {seqs} seqs x {ctx} context, {hq}/{hkv} heads of {d}, block {bs}, "
        f"median of {rounds}:"
    )
    for op in ("attention", "write_kv"):
        print(
            f"  {op:9s}: fp32 cache {med[op + ' fp32']:.3f} ms, fp8 cache {med[op + ' fp8']:.3f} ms, "
            f"ratio fp8 / fp32 {med[op + ' fp8'] / med[op + ' fp32']:.3f}"
        )


GREEDY_PROMPTS = [t.split(" is ")[0] + " is" for t in TEXTS]


def _smollm2(path: Path) -> None:
    from engine.core.params import SamplingParams
    from engine.entrypoints.llm import LLM

    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    ref = None
    for label, kw in (
        ("fp32 KV", {}),
        ("fp8 KV (scales 1.0)", dict(kv_cache_dtype="fp8")),
        ("fp8 KV (calibrated)", dict(kv_cache_dtype="fp8", calculate_kv_scales=True)),
        ("bf16 model", dict(dtype="bfloat16")),
    ):
        llm = LLM(str(path), device="cpu", enforce_eager=True, max_model_len=256, max_num_seqs=20, **kw)
        scored = llm.generate(TEXTS, score, use_tqdm=False)
        gen = llm.generate(GREEDY_PROMPTS, greedy, use_tqdm=False)
        del llm
        if ref is None:
            ref = scored, gen
            continue
        same, drift = [], []
        for a, b in zip(ref[0], scored):
            ids = list(a.prompt_token_ids)
            for i in range(max(1, len(ids) - 32), len(ids)):
                la, lb = a.prompt_logprobs[i], b.prompt_logprobs[i]
                same.append(max(la, key=la.get) == max(lb, key=lb.get))
                drift.append(abs(la[ids[i]] - lb[ids[i]]))
        pairs = [(x, y) for a, b in zip(ref[1], gen) for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids)]
        print(
            f"SmolLM2-135M {label} vs fp32 KV: position-wise top-1 agreement {sum(same) / len(same):.4f} "
            f"over {len(same)} positions, drift mean {sum(drift) / len(drift):.4f} max {max(drift):.4f}; "
            f"greedy 20 x 32 token agreement {sum(x == y for x, y in pairs) / len(pairs):.4f}"
        )


OFF_CORPUS = [
    "Once upon a time there was",
    "My favourite colour is",
    "The weather in London today",
    "Quantum computers use qubits",
    "She opened the door and saw",
    "def main():\n    print(",
    "In 1492 Columbus sailed",
    "Roses are red, violets are",
    "The stock market fell sharply",
    "Please summarise the following",
]


def _truncating_to_cache(x, cache_dtype, scale):
    """A broken quantiser for the gate's resolution: rounds toward zero instead of to nearest."""
    from compiler.kernels.kv_quant import FP8_MAX, is_fp8

    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    y = (x.float() if scale is None else x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return (y.view(torch.int32) & ~((1 << 20) - 1)).view(torch.float32).to(cache_dtype)  # keep 3 mantissa bits


def _broken(kind: str):
    """A context manager that breaks the reference cache path one way (eager engines only)."""
    import contextlib

    import compiler.kernels.ops
    import compiler.kernels.reference_attention as reference
    import engine.layers.attention.torch_backend

    write, read = reference.write_kv_reference, reference.from_cache
    if kind == "truncating quantiser":
        patches = [(reference, "to_cache", _truncating_to_cache)]
    elif kind == "read back x16":
        patches = [(reference, "from_cache", lambda x, dtype, scale: read(x, dtype, scale * 16))]
    else:

        def bad_write(k, v, kc, vc, slots, ks=None, vs=None):
            return (
                write(v, k, kc, vc, slots, ks, vs)
                if kind == "K/V swapped"
                else write(k, torch.zeros_like(v), kc, vc, slots, ks, vs)
            )

        patches = [
            (mod, "write_kv_reference", bad_write)
            for mod in (compiler.kernels.ops, engine.layers.attention.torch_backend)
        ]

    @contextlib.contextmanager
    def patched():
        saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
        for m, n, f in patches:
            setattr(m, n, f)
        try:
            yield
        finally:
            for m, n, f in saved:
                setattr(m, n, f)

    return patched()


def _trained(steps: int) -> None:
    from engine.entrypoints.llm import LLM
    from engine.models.tiny_model import make_tiny_model
    from tests.layers.test_fp8_kv import FIDELITY_PROMPTS, GREEDY, logprob_drift, token_agreement

    fp8, calibrated = dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    print(
        f"Trained tiny models ({steps} steps), greedy 32 tokens, eager CPU; gate: 20 prompts (10 corpus pieces, "
        "10 unseen text leading into the corpus); off: 10 prompts that never meet the corpus"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen3"):
            t0 = time.perf_counter()
            model = make_tiny_model(Path(tmp) / arch, arch=arch, seed=1, train_steps=steps)
            print(f"  {arch}: trained in {time.perf_counter() - t0:.1f} s")
            for dtype in ("bfloat16", "float32"):
                variants = [("fp8 KV, scales 1.0", fp8, None), ("fp8 KV, calibrated", calibrated, None)]
                variants += [
                    (f"BROKEN: {k}", calibrated, k)
                    for k in ("read back x16", "K/V swapped", "V zeroed", "truncating quantiser")
                ]
                if dtype == "float32":
                    variants.append(("bf16 model", dict(dtype="bfloat16"), None))
                runs = {}
                for label, kw, broken in [("ref", {}, None)] + variants:
                    settings = dict(dtype=dtype) | kw
                    llm = LLM(str(model), device="cpu", enforce_eager=True, max_model_len=128, **settings)
                    with _broken(broken) if broken else contextlib.nullcontext():
                        runs[label] = (
                            llm.generate(FIDELITY_PROMPTS, GREEDY, use_tqdm=False),
                            llm.generate(OFF_CORPUS, GREEDY, use_tqdm=False),
                        )
                    del llm
                ref = runs.pop("ref")
                for label, (gate, off) in runs.items():
                    mean, worst = logprob_drift(ref[0], gate)
                    print(
                        f"    {arch} {dtype} model, {label} vs {dtype} KV: gate agreement "
                        f"{token_agreement(ref[0], gate):.4f} (drift mean {mean:.4f} max {worst:.4f}); "
                        f"off-corpus agreement {token_agreement(ref[1], off):.4f}"
                    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gb", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trained", action="store_true", help="the fidelity gate's figures on trained tiny models")
    ap.add_argument("--train-steps", type=int, default=500)
    ap.add_argument("--no-speed", action="store_true", help="skip parts 1-3 (blocks, throughput, the op)")
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf: agreement on it")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from engine.models.tiny_model import make_tiny_model

    if not args.no_speed:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=1)
            _blocks(model, args.budget_gb)
            _throughput(model, args.batch, args.prompt_len, args.new_tokens, args.rounds)
        _attention_op()
    if args.trained:
        _trained(args.train_steps)
    if args.smollm2 is not None:
        _smollm2(args.smollm2)


if __name__ == "__main__":
    main()
