"""A fake device for tools/gpu_check.sh (GPU_CHECK_FAKE=1): each stage's command on the CPU.

    gpu_check_fake.py model DIR                       a tiny Llama checkpoint for the latency stages
    gpu_check_fake.py run [--make-model DIR] [--crash-at-batch B] -- ARGS
        the real `kiln bench latency ARGS` driver (--make-model: make the tiny checkpoint first
        unless there, atomically: engines start together); with --crash-at-batch the process kills itself
        with SIGSEGV when batch B starts, after printing a CUDA-style error (a sticky fault)
    gpu_check_fake.py junit GROUP XML [--crash]       a tests-stage process: two passing cases
    gpu_check_fake.py kernel-cache JSON               the kernel-cache stage's report
    gpu_check_fake.py kernel-bench JSON --decode-kernel K --prefill-kernel K [--crash]
        the kernel bench's JSON, written after each section as the real one writes it; --crash
        dies after the decode section
    gpu_check_fake.py bench NAME JSON [--crash]       any other benchmark: one row, then the end

Stubs write what the real commands write (the same file names and keys that tools/gpu_summary.py
reads), so the dry run checks the script's bookkeeping: every stage's JSON is there even when a
stage crashes halfway, and the summary names the crash. The figures are made up and marked
`"fake": true`; the latency figures are real CPU measurements, and never scored (torch backend).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

FAULT = "RuntimeError: CUDA error: an illegal memory access was encountered (fake device)"


def crash() -> None:
    print(FAULT, file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)


def write(path: str, data) -> None:
    Path(path).write_text(json.dumps(data, indent=1))


def cmd_model(args) -> int:
    print(make_model(Path(args.dir)))
    return 0


def make_model(path: Path) -> Path:
    """The tiny checkpoint at `path`, made unless there (in a temporary directory, then renamed)."""
    import tempfile

    from engine.models.tiny_model import make_tiny_model

    if not path.is_dir():
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        make_tiny_model(tmp / "m", arch="llama", seed=1)
        try:
            (tmp / "m").rename(path)
        except OSError:  # another engine made it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def cmd_run(args) -> int:
    from engine.bench import latency

    if args.make_model:
        make_model(Path(args.make_model))
    real = latency.bench_one

    def bench_one(engine, batch, *rest, **kw):
        if batch == args.crash_at_batch:
            crash()
        return real(engine, batch, *rest, **kw)

    latency.bench_one = bench_one
    return latency.main(args.rest)


def cmd_junit(args) -> int:
    if args.crash:
        crash()
    cases = "".join(f"<testcase classname='tests.fake' name='test_fake[{args.group}-{i}]' time='0.1'/>" for i in (1, 2))
    Path(args.xml).write_text(f"<testsuites><testsuite name='pytest'>{cases}</testsuite></testsuites>")
    print(f"2 passed (fake {args.group})")
    return 0


def cmd_kernel_cache(args) -> int:
    write(args.json, {"fake": True, "variants": 69, "hits": 69, "missing": [], "still_missing": [], "loaded": 69})
    return 0


def cmd_kernel_bench(args) -> int:
    result = {"fake": True, "decode_kernel": args.decode_kernel, "prefill_kernel": args.prefill_kernel,
              "backend": "cutlass", "timing": "CUDA-graph replay", "device": "fake", "complete": False,
              "copy_GBps": 4200.0}
    write(args.json, result)
    result["decode"] = [{"kind": "decode", "batch": 64, "ctx": 2048, "kiln_us": 150.0, "kiln_GBps": 3580.0}]
    write(args.json, result)
    if args.crash:
        crash()
    result.update(prefill=[{"kind": "prefill", "heads": "32/8", "batch": 4, "seq": 4096, "kiln_TFLOPs": 400.0}],
                  complete=True)
    write(args.json, result)
    return 0


def cmd_bench(args) -> int:
    write(args.json, {"fake": True, "bench": args.name, "rows": [{"case": 1, "us": 10.0}], "complete": False})
    if args.crash:
        crash()
    write(args.json, {"fake": True, "bench": args.name, "rows": [{"case": 1, "us": 10.0}], "complete": True})
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu_check_fake.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("model")
    s.add_argument("dir")
    s = sub.add_parser("run")
    s.add_argument("--make-model", default=None)
    s.add_argument("--crash-at-batch", type=int, default=None)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s = sub.add_parser("junit")
    s.add_argument("group")
    s.add_argument("xml")
    s.add_argument("--crash", action="store_true")
    s = sub.add_parser("kernel-cache")
    s.add_argument("json")
    s = sub.add_parser("kernel-bench")
    s.add_argument("json")
    s.add_argument("--decode-kernel", required=True)
    s.add_argument("--prefill-kernel", required=True)
    s.add_argument("--crash", action="store_true")
    s = sub.add_parser("bench")
    s.add_argument("name")
    s.add_argument("json")
    s.add_argument("--crash", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "run" and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    return {"model": cmd_model, "run": cmd_run, "junit": cmd_junit, "kernel-cache": cmd_kernel_cache,
            "kernel-bench": cmd_kernel_bench, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
