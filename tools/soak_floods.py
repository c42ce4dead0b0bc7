"""The hardening soak's floods, one `kiln serve` per checkout side by side, the cases interleaved:
another stream's longest gap and /health's slowest answer while each body arrives, against a quiet
baseline of the same length (issue 39: under 0.25 s whatever one request sends).

    python tools/soak_floods.py --tree /work/main --tree . [--runs 3] [--copies 4] [--case NAME ...]

Each tree serves a tiny random Llama (or `--model`) with tools/soak_server.py's flags; every run
takes the cases in turn and, within a case, the trees in turn (order alternating run by run), so
both see the same load. Prints each case's median and max per tree and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script from the checkout)

from tools import soak_server  # noqa: E402


def ids_body(count: int, truncate: bool = True, item: bytes = b"12") -> bytes:
    """A completion whose prompt is `count` token ids (kept to its last 8: it fits and runs)."""
    extra = b', "truncate_prompt_tokens": 8' if truncate else b""
    return b'{"model": "m", "max_tokens": 2, "prompt": [' + b",".join([item] * count) + b"]" + extra + b"}"


def literals_body(count: int) -> bytes:
    return b'{"model": "m", "prompt": "hi", "max_tokens": 2, "x": [' + b",".join([b"true"] * count) + b"]}"


CASES = {  # name -> (path, body); the soak's own floods first
    **soak_server.FLOODS,
    "990k token ids (truncated: 200)": ("/v1/completions", ids_body(990_000)),
    "990k bad ids (floats: 400)": ("/v1/completions", ids_body(990_000, item=b"1.5")),
    "990k true literals": ("/v1/completions", literals_body(990_000)),
    "1536 lists of 600 ids, the last bad (400)": (
        "/v1/completions",
        json.dumps({"model": "m", "max_tokens": 2, "prompt": [[1] * 600] * 1535 + [[1.5] * 600]}).encode(),
    ),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path, help="a checkout (repeat; default: this one)")
    p.add_argument("--model", type=Path, help="a checkpoint to serve (default: a tiny random Llama)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--copies", type=int, default=4, help="concurrent copies of each body")
    p.add_argument("--case", action="append", help="only these cases (repeat; default: all)")
    args = p.parse_args()
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parents[1]])]
    cases = {"quiet": None, **{k: v for k, v in CASES.items() if not args.case or k in args.case}}
    work = Path(tempfile.mkdtemp(prefix="kiln-floods-"))
    model = args.model
    if model is None:
        from engine.models.tiny_model import make_tiny_model

        model = make_tiny_model(work / "tiny-llama", arch="llama", seed=1)
    servers = {}
    got: dict[tuple[str, Path], list[tuple[float, float]]] = {}
    loads = []
    try:
        for i, tree in enumerate(trees):
            servers[tree] = soak_server.start(model, work / f"tree{i}", tree=tree)
        for run in range(args.runs):
            for name, case in cases.items():
                for tree in trees if run % 2 == 0 else trees[::-1]:
                    bodies, copies = ([], 0) if case is None else ([case], args.copies)
                    gap, health, statuses = soak_server.flood_gaps(servers[tree][1], bodies, copies)
                    got.setdefault((name, tree), []).append((gap, health))
                    loads.append(os.getloadavg()[0])
                    print(f"run {run + 1} {name} {tree}: gap {gap:.3f}s, /health {health:.3f}s, {statuses}", flush=True)
    finally:
        for i, (proc, _) in enumerate(servers.values()):
            soak_server.stop_server(proc, work / f"tree{i}" / "server.log")
    print(f"\n{args.copies} copies at once; load average {min(loads):.1f}-{max(loads):.1f}; "
          "another stream's longest gap / /health's slowest answer, median (max) of the runs")  # fmt: skip
    print("| case | " + " | ".join(str(t) for t in trees) + " |\n|---|" + "---|" * len(trees))
    for name in cases:
        cells = []
        for tree in trees:
            gaps, healths = zip(*got[(name, tree)])
            cells.append(
                f"{statistics.median(gaps):.3f} / {statistics.median(healths):.3f} s "
                f"(max {max(gaps):.3f} / {max(healths):.3f})"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
