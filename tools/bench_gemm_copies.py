"""oneDNN's packed GEMM copies (engine/worker/cpu_gemm_weights.py) against the plain weight, in one
process: the copies are made once (cpu_gemm_packed_weights=on) and swapped in and out between runs,
the order alternating by round, so both modes see the same load. Prefill tok/s at 128 and 4096
tokens, decode tok/s at batch 1 and 16 (32 tokens past the first).

    python tools/bench_gemm_copies.py MODEL [ROUNDS] [TOKENIZER]
"""

from __future__ import annotations

import sys
import time

import torch

from engine.core.params import SamplingParams
from engine.entrypoints.llm import LLM


def main() -> None:
    model = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    kw = dict(tokenizer=sys.argv[3]) if len(sys.argv) > 3 else {}
    llm = LLM(
        model,
        device="cpu",
        max_model_len=4608,
        max_num_seqs=16,
        cpu_gemm_packed_weights="on",
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        **kw,
    )
    m = llm.engine.core.model
    packed = {mod: mod.gemm_weight for mod in m.modules() if getattr(mod, "gemm_weight", None) is not None}
    head = m.gemm_head
    print("packed weights:", len(packed), "head:", head is not None, flush=True)

    def use_copies(on: bool) -> None:
        for mod, w in packed.items():
            mod.gemm_weight = w if on else None
        m.gemm_head = head if on else None

    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, 500, (n,), generator=gen).tolist()

    def seconds(prompts: list[list[int]], out: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    seconds([prompt(64)], 2)  # warm
    res: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            use_copies(on)
            mode = "packed" if on else "plain"
            for n in (128, 4096):
                res.setdefault((mode, f"prefill{n}"), []).append(n / seconds([prompt(n)], 1))
            for b in (1, 16):
                ps = [prompt(16) for _ in range(b)]
                first, all_ = seconds(ps, 2), seconds(ps, 34)
                res.setdefault((mode, f"decode_b{b}"), []).append(32 * b / (all_ - first))
            print(r, mode, {k[1]: round(v[-1], 1) for k, v in res.items() if k[0] == mode}, flush=True)
    for metric in ("prefill128", "prefill4096", "decode_b1", "decode_b16"):
        a, b = res[("packed", metric)], res[("plain", metric)]
        pa, pb = [round(x, 1) for x in a], [round(x, 1) for x in b]
        print(f"{metric}: packed {pa} plain {pb} plain/packed {sum(b) / sum(a):.3f}")


if __name__ == "__main__":
    main()
