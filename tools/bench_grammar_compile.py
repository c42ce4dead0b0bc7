"""Grammar compiles: in-thread (xgrammar, not interruptible) vs the server's killable worker pool.

Prints:
- how long the pool's workers take to start (paid at server start-up, not by a request);
- for a few ordinary constraints, the time of an inline compile and of a pool compile (the
  worker's time-limited compile, then the same compile in the server), and their ratio;
- for JSON schemas of N required properties: inline, the pool as it is (worker check, then the
  server compiles), and the pool as it was (the worker's compiled grammar serialised to JSON,
  piped back and deserialised; skipped past --old-max properties, where it takes minutes and
  gigabytes), with the ratio old / new measured in the same run;
- how long a pathological schema holds each: the thread until it finishes (here cut off by a
  time budget and reported as "> budget"), the pool until its time limit kills it.

    PYTHONPATH=$PWD python tools/bench_grammar_compile.py [--model DIR | --gguf FILE] [--timeout 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time


def required_schema(n: int, tag: str) -> dict:
    return {
        "type": "object",
        "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)},
        "required": [f"{tag}{i}" for i in range(n)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny one made here)")
    ap.add_argument("--gguf", default=None, help="a GGUF file whose tokenizer to use (e.g. SmolLM2's, 49k tokens)")
    ap.add_argument("--timeout", type=float, default=10.0, help="the pool's time limit (the server's default: 10)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sizes", default="100,300,1000,5000", help="required-property counts to time")
    ap.add_argument("--old-max", type=int, default=300, help="largest schema the old (serialising) path is timed on")
    args = ap.parse_args()

    import transformers
    import xgrammar

    from engine.core.params import StructuredOutputsParams
    from engine.structured_output.compile_pool import CompilePool, compile_with
    from engine.structured_output.grammars import StructuredOutputCompiler, _grammar_source

    if args.gguf is not None:
        import os

        tok = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(args.gguf), gguf_file=os.path.basename(args.gguf)
        )
    else:
        model = args.model
        if model is None:
            from engine.models.tiny_model import make_tiny_model

            model = str(make_tiny_model(tempfile.mkdtemp() + "/tiny", arch="llama", seed=1))
        tok = transformers.AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    inline = StructuredOutputCompiler(tok, vocab, (tok.eos_token_id,), cache_entries=1)
    pooled = StructuredOutputCompiler(tok, vocab, (tok.eos_token_id,), cache_entries=1)
    pooled.configure(timeout_s=args.timeout, workers=2)
    t0 = time.perf_counter()
    pooled.start_pool()
    pooled.compile(StructuredOutputsParams(regex="warm"))
    print(
        f"vocabulary {vocab}; the pool started and answered its first compile in "
        f"{time.perf_counter() - t0:.2f}s (paid at server start-up, not by a request)"
    )

    specs = {
        "regex email": lambda i: StructuredOutputsParams(regex=f"[a-z]{{1,{10 + i}}}@[a-z]+\\.(com|org)"),
        "json 10 props": lambda i: StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {f"f{i}_{k}": {"type": "integer"} for k in range(10)},
                "required": [f"f{i}_{k}" for k in range(5)],
            }
        ),
        "choice 50": lambda i: StructuredOutputsParams(choice=[f"option {i} {k}" for k in range(50)]),
    }
    print(f"{args.repeat} distinct constraints of each kind (no cache hits)")
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

    # The pool as it was: one worker, its compiled grammar sent back as JSON and deserialised.
    old = CompilePool(pooled._info.serialize_json(), 1, 600.0)
    old_compiler = xgrammar.GrammarCompiler(pooled._info, cache_enabled=False)

    def old_path(source) -> float:
        """The worker's compile, then its grammar serialised and deserialised (the pipe itself,
        96 MB for 500 properties, not counted: the old path is timed on the low side)."""
        t0 = time.perf_counter()
        old.submit(source).future.result()
        worker = time.perf_counter() - t0
        grammar = compile_with(old_compiler, *source)  # the worker's grammar, made here (not timed)
        t0 = time.perf_counter()
        xgrammar.CompiledGrammar.deserialize_json(grammar.serialize_json(), pooled._info)
        return worker + time.perf_counter() - t0

    print(
        f"\nJSON schemas of N required string properties (the pool's limit: {args.timeout:g}s of the worker's CPU time)"
    )
    print(f"{'N':>6}{'inline s':>10}{'pool s':>10}{'worker CPU s':>14}{'old pool s':>12}{'old/new':>9}")
    pool = pooled._pool
    for size in (int(x) for x in args.sizes.split(",")):
        t0 = time.perf_counter()
        inline.compile(StructuredOutputsParams(json=required_schema(size, "i")))
        t_inline = time.perf_counter() - t0
        spec = StructuredOutputsParams(json=required_schema(size, "p"))
        job = pool.submit(_grammar_source(spec))  # the worker's part alone, for its CPU time
        try:
            job.future.result()
        except Exception:  # noqa: BLE001 - past the time limit
            pass
        cpu = f"{job.cpu_seconds:.2f}" if job.cpu_seconds is not None else "-"
        t0 = time.perf_counter()
        try:
            pooled.compile(spec)
            t_pool = f"{time.perf_counter() - t0:.2f}"
        except Exception as exc:  # noqa: BLE001 - past the time limit
            t_pool = f"refused ({type(exc).__name__})"
        old_s = ratio = "-"
        if size <= args.old_max:
            t_old = old_path(_grammar_source(StructuredOutputsParams(json=required_schema(size, "o"))))
            old_s = f"{t_old:.2f}"
            ratio = f"{t_old / float(t_pool):.1f}" if not t_pool.startswith("refused") else "-"
        print(f"{size:>6}{t_inline:>10.2f}{t_pool:>10}{cpu:>14}{old_s:>12}{ratio:>9}")
    old.close()

    bad = StructuredOutputsParams(
        json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    )
    t0 = time.perf_counter()
    try:
        pooled.compile(bad)
        outcome = "compiled"
    except Exception as exc:  # noqa: BLE001 - the time-limit error
        outcome = f"refused ({type(exc).__name__})"
    print(f"\n5000 optional properties, pool: {outcome} after {time.perf_counter() - t0:.1f}s")
    budget = 3 * args.timeout
    done = threading.Event()

    def run() -> None:
        try:
            inline.compile(bad)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(budget)
    print(
        f"5000 optional properties, thread: {'finished' if finished else f'still compiling after {budget:.0f}s'} "
        "(a thread cannot be stopped: it keeps its cores until xgrammar returns)"
    )
    pooled.close()


if __name__ == "__main__":
    main()
