"""Grammar compiles: in-thread (xgrammar, not interruptible) vs the server's killable worker pool.

Prints, for a few ordinary constraints, the time of an inline compile and of a pool compile
(warm workers: the job's round trip, the worker's compile, the parent's deserialisation), their
ratio, and how long a pathological schema holds each: the thread until it finishes (here cut
off by a time budget and reported as "> budget"), the pool until its time limit kills it.

    PYTHONPATH=$PWD python tools/bench_grammar_compile.py [--model DIR | --gguf FILE] [--timeout 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny one made here)")
    ap.add_argument("--gguf", default=None, help="a GGUF file whose tokenizer to use (e.g. SmolLM2's, 49k tokens)")
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import transformers

    from engine.core.request import StructuredOutputsParams
    from engine.structured_output.grammars import StructuredOutputCompiler

    if args.gguf is not None:
        import os

        tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(args.gguf),
                                                         gguf_file=os.path.basename(args.gguf))
    else:
        model = args.model
        if model is None:
            from engine.models.tiny_model import make_tiny_model

            model = str(make_tiny_model(tempfile.mkdtemp() + "/tiny", arch="llama", seed=1))
        tok = transformers.AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    specs = {
        "regex email": lambda i: StructuredOutputsParams(regex=f"[a-z]{{1,{10 + i}}}@[a-z]+\\.(com|org)"),
        "json 10 props": lambda i: StructuredOutputsParams(json={
            "type": "object", "properties": {f"f{i}_{k}": {"type": "integer"} for k in range(10)},
            "required": [f"f{i}_{k}" for k in range(5)]}),
        "choice 50": lambda i: StructuredOutputsParams(choice=[f"option {i} {k}" for k in range(50)]),
    }
    inline = StructuredOutputCompiler(tok, vocab, (tok.eos_token_id,), cache_entries=1)
    pooled = StructuredOutputCompiler(tok, vocab, (tok.eos_token_id,), cache_entries=1)
    pooled.configure(timeout_s=args.timeout, workers=2)
    pooled.compile(StructuredOutputsParams(regex="warm"))  # start the workers (not timed)
    print(f"vocabulary {vocab}; {args.repeat} distinct constraints of each kind (no cache hits)")
    print(f"{'constraint':<16}{'inline ms':>12}{'pool ms':>12}{'pool/inline':>14}")
    n = 0
    for name, make in specs.items():
        t_in, t_pool = [], []
        for _ in range(args.repeat):
            n += 1
            t0 = time.perf_counter()
            inline.compile(make(n))
            t_in.append(time.perf_counter() - t0)
            n += 1
            t0 = time.perf_counter()
            pooled.compile(make(n))
            t_pool.append(time.perf_counter() - t0)
        a, b = statistics.median(t_in) * 1e3, statistics.median(t_pool) * 1e3
        print(f"{name:<16}{a:>12.1f}{b:>12.1f}{b / a:>14.2f}")

    bad = StructuredOutputsParams(json={"type": "object",
                                        "properties": {f"p{i}": {"type": "string"} for i in range(5000)}})
    t0 = time.perf_counter()
    try:
        pooled.compile(bad)
    except Exception as exc:  # noqa: BLE001 - the expected time-limit error
        print(f"pathological schema, pool: refused after {time.perf_counter() - t0:.1f}s ({type(exc).__name__})")
    budget = 3 * args.timeout
    done = threading.Event()

    def run() -> None:
        try:
            inline.compile(bad)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(budget)
    print(f"pathological schema, thread: {'finished' if finished else f'still compiling after {budget:.0f}s'} "
          "(a thread cannot be stopped: it keeps its cores until xgrammar returns)")
    pooled.close()


if __name__ == "__main__":
    main()
