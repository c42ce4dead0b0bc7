"""A fake device for tools/gpu_check.sh (GPU_CHECK_FAKE=1): each stage's command on the CPU.

    gpu_check_fake.py model DIR                       a tiny Llama checkpoint for the latency stages
    gpu_check_fake.py run [--make-model DIR] [--crash-at-batch B] -- ARGS
        the real `kiln bench latency ARGS` driver (--make-model: make the tiny checkpoint first
        unless there, atomically: engines start together); with --crash-at-batch the process kills itself
        with SIGSEGV when batch B starts, after printing a CUDA-style error (a sticky fault)
    gpu_check_fake.py collect PREFIX -- NAME|PYTEST-ARGS ...
        every test group's real pytest arguments collected (`--collect-only`, torch.cuda reporting
        an sm_90 GPU, xdist's -n dropped where xdist is not installed) in this one process, into
        PREFIX-NAME.collect.json
    gpu_check_fake.py group [--crash] [--hang] PREFIX -- PYTEST-ARGS
        a tests-stage process: its collection (PREFIX.collect.json, made by `collect` for the same
        arguments, or here), with this process's settings added; a missing path, a collection error
        or no test collected fails it (rc 3). Then pytest runs one stand-in test per test collected into the arguments'
        --junitxml file; --crash: SIGSEGV in the second one, --hang: the third never ends
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
import importlib.util
import json
import os
import shlex
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


# pytest options of the test groups that take a value (the rest of the words are paths)
VALUE_OPTIONS = {"-k", "-m", "-n", "-p", "--timeout"}
# what tools/gpu_check.sh sets for a group's process, recorded with its collection
GROUP_ENV = ("TORCHINDUCTOR_COMPILE_THREADS", "KILN_NUM_GPU_BLOCKS", "KILN_GPU_CHECK_STRICT")


def paths_of(words: list[str]) -> list[str]:
    paths, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in VALUE_OPTIONS:
            skip = True
        elif not word.startswith("-"):
            paths.append(word)
    return paths


def collect(words: list[str]) -> tuple[int, list[str], list[str]]:
    """pytest --collect-only of `words` in this process, as on an sm_90 GPU: (rc, node ids,
    collection errors). (The GPU test modules skip as a whole without CUDA: nothing to count.)"""
    import pytest
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)

    class Collector:
        def __init__(self) -> None:
            self.nodes: list[str] = []
            self.errors: list[str] = []

        def pytest_collectreport(self, report):
            if report.failed or (report.skipped and report.nodeid.endswith(".py")):
                self.errors.append(f"{report.nodeid}: {str(report.longrepr)[-300:]}")

        def pytest_collection_finish(self, session):
            self.nodes = [item.nodeid for item in session.items]

    c = Collector()
    rc = int(pytest.main(["--collect-only", *words], plugins=[c]))
    return rc, c.nodes, c.errors


STAND_IN = """import os, signal, sys, time
import pytest
NODES = {nodes!r}

@pytest.mark.parametrize("node", NODES, ids=NODES)
def test_stand_in(node):
    i = NODES.index(node)
    if {crash!r} and i == 1:
        print({fault!r}, file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if {hang!r} and i == 2:
        time.sleep(3600)
"""


def group_words(rest: list[str]) -> tuple[list[str], list[str]]:
    """A group's pytest words as collected: no --junitxml, xdist's -n dropped where xdist is not
    installed; (words, what was dropped)."""
    words = [w for w in rest if not w.startswith("--junitxml=")]
    if "-n" in words and importlib.util.find_spec("xdist") is None:  # (installed on the device from .whl/)
        i = words.index("-n")
        return words[:i] + words[i + 2 :], words[i : i + 2]
    return words, []


def collect_group(words: list[str], dropped: list[str]) -> dict:
    """A group's collection report (its paths checked first: a missing one is not collected)."""
    missing = [p for p in paths_of(words) if not Path(p.split("::")[0]).exists()]
    rc, nodes, errors = (0, [], []) if missing else collect(words)
    return {"args": words, "dropped": dropped, "rc": rc, "nodes": nodes, "errors": errors, "missing": missing}


def cmd_collect(args) -> int:
    """Every group's collection in this one process (torch and the test modules imported once, not
    once per group): PREFIX-NAME.collect.json for each NAME|PYTEST-ARGS, read by `group`."""
    for entry in args.entries:
        name, _, line = entry.partition("|")
        report = collect_group(*group_words(shlex.split(line)))
        write(f"{args.prefix}-{name}.collect.json", dict(report, shared=True))
    return 0


def cmd_group(args) -> int:
    words, dropped = group_words(args.rest)
    junit = next((w.split("=", 1)[1] for w in args.rest if w.startswith("--junitxml=")), None)
    path = Path(f"{args.prefix}.collect.json")
    report = json.loads(path.read_text()) if path.exists() else None
    if report is None or report["args"] != words:  # not collected by `collect` for these words: here
        report = dict(collect_group(words, dropped), shared=False)
    # what this process (the one that runs the tests) was given
    report.update(junit=junit, env={k: os.environ.get(k) for k in GROUP_ENV})
    write(str(path), report)
    nodes, errors, missing, rc = report["nodes"], report["errors"], report["missing"], report["rc"]
    problems = (
        [f"no such path: {p}" for p in missing]
        + [f"collection error: {e}" for e in errors]
        + ([f"pytest --collect-only rc={rc}"] if rc not in (0, 5) else [])
        + ([] if nodes or missing else ["no test collected"])
    )
    if problems:
        print("\n".join(f"FAKE GROUP FAILED: {p}" for p in problems), flush=True)
        return 3
    print(f"collected {len(nodes)} tests ({' '.join(words)}); running their stand-ins", flush=True)
    tmp = Path(f"{args.prefix}.stand-in")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "pytest.ini").write_text("[pytest]\n")  # (not the repository's settings and conftest)
    (tmp / "test_stand_in.py").write_text(STAND_IN.format(nodes=nodes, crash=args.crash, hang=args.hang, fault=FAULT))
    sys.stdout.flush()
    # exec: the group's timeout signals pytest itself. No plugin but pytest's own: the stand-ins need
    # none, and the installed ones (hypothesis, schemathesis...) cost ~2 s of CPU per group to import.
    os.execve(
        sys.executable,
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(tmp / "pytest.ini"),
            str(tmp / "test_stand_in.py"),
        ]
        + ([f"--junitxml={junit}"] if junit else []),
        dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"),
    )


def cmd_kernel_cache(args) -> int:
    write(args.json, {"fake": True, "variants": 69, "hits": 69, "missing": [], "still_missing": [], "loaded": 69})
    return 0


def cmd_kernel_bench(args) -> int:
    result = {
        "fake": True,
        "decode_kernel": args.decode_kernel,
        "prefill_kernel": args.prefill_kernel,
        "backend": "cutlass",
        "timing": "CUDA-graph replay",
        "device": "fake",
        "complete": False,
        "copy_GBps": 4200.0,
    }
    write(args.json, result)
    result["decode"] = [{"kind": "decode", "batch": 64, "ctx": 2048, "kiln_us": 150.0, "kiln_GBps": 3580.0}]
    write(args.json, result)
    if args.crash:
        crash()
    result.update(
        prefill=[{"kind": "prefill", "heads": "32/8", "batch": 4, "seq": 4096, "kiln_TFLOPs": 400.0}], complete=True
    )
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
    s = sub.add_parser("collect")
    s.add_argument("prefix")
    s.add_argument("entries", nargs=argparse.REMAINDER)
    s = sub.add_parser("group")
    s.add_argument("prefix")
    s.add_argument("--crash", action="store_true")
    s.add_argument("--hang", action="store_true")
    s.add_argument("rest", nargs=argparse.REMAINDER)
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
    if args.cmd in ("run", "group") and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    if args.cmd == "collect" and args.entries[:1] == ["--"]:
        args.entries = args.entries[1:]
    return {
        "model": cmd_model,
        "run": cmd_run,
        "collect": cmd_collect,
        "group": cmd_group,
        "kernel-cache": cmd_kernel_cache,
        "kernel-bench": cmd_kernel_bench,
        "bench": cmd_bench,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
