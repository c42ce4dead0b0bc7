"""`kiln build-kernels [--variants a,b] [--jobs N] [--cache-dir DIR] [--list | --check [--json F]]`.

--check: which variants the loader finds in the cache (a hit needs no nvcc), build only the
missing or stale ones (where nvcc is), and with a GPU load every cubin into it
(tools/gpu_check.sh's kernel-cache stage). Exit 0 only if every variant is there and loads.

Also runnable as `python -m compiler.kernels.cli ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/kiln/kernels")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln build-kernels", description="Build kiln's attention kernels (nvcc, sm_90a).")
    p.add_argument("--variants", default=None, help="comma-separated variant names (default: the whole manifest)")
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: CPU count)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"kernel cache (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--list", action="store_true", help="list the variants and whether they are built; build nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true",
                   help="report cache hits, build only what is missing, load every cubin where a GPU is")
    p.add_argument("--json", type=Path, default=None, help="--check: also write the report here")
    return p


def build_main(argv: list[str]) -> int:
    from compiler.kernels.build import KernelBuildError, NvccNotFoundError, build_kernels, read_index
    from compiler.kernels.manifest import ManifestError, TemplateRenderError, load_manifest, select_variants

    args = _parser().parse_args(argv)
    cache_dir = args.cache_dir.expanduser()
    manifest = load_manifest()
    names = [n.strip() for n in args.variants.split(",") if n.strip()] if args.variants else None
    try:
        variants = select_variants(names, manifest)
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        return _check([v.name for v in variants], cache_dir, args)
    if args.list:
        index = read_index(cache_dir)
        for v in variants:
            rec = index.get(v.name)
            if rec is None:
                print(f"{v.name:32s} missing")
                continue
            res = rec.get("resources", {})
            worst = max((r["registers"] for r in res.values()), default=0)
            spills = sum(r["spill_stores"] + r["spill_loads"] for r in res.values())
            print(f"{v.name:32s} built  {len(res)} functions, max {worst} regs, {spills} spill bytes  {rec['cubin']}")
        return 0
    try:
        results = build_kernels(cache_dir, [v.name for v in variants], jobs=args.jobs, progress=not args.quiet)
    except NvccNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KernelBuildError, TemplateRenderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    built = sum(not r.cached for r in results)
    print(f"{len(results)} variants in {cache_dir} ({built} compiled, {len(results) - built} cached)")
    for r in results:
        for fn, res in r.resources.items():
            flag = "  SPILLS" if res.spill_stores or res.spill_loads else ""
            print(f"  {fn:48s} {res.registers:4d} regs {res.shared_bytes:6d} B smem {res.stack_bytes:4d} B stack{flag}")
    return 0


def _check(names: list[str], cache_dir: Path, args) -> int:
    import json

    from compiler.kernels.build import build_kernels, find_nvcc
    from compiler.kernels.loader import KernelLibrary, missing_variants

    report = {"cache_dir": str(cache_dir), "variants": len(names)}
    missing = missing_variants(cache_dir, names)
    report.update(hits=len(names) - len(missing), missing=missing)
    if missing and find_nvcc() is not None:
        try:
            results = build_kernels(cache_dir, missing, jobs=args.jobs, progress=False)
            report["built"] = sum(not r.cached for r in results)
        except Exception as e:  # noqa: BLE001 - reported, the check fails
            report["build_error"] = str(e)[:2000]
        missing = missing_variants(cache_dir, names)
    report["still_missing"] = missing
    ok = not missing
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu and ok:
        try:
            KernelLibrary(cache_dir, names).load("cuda")
            report["loaded"] = len(names)
        except Exception as e:  # noqa: BLE001 - reported, the check fails
            report["load_error"] = str(e)[:2000]
            ok = False
    print(f"kernel cache {cache_dir}: {report['hits']}/{len(names)} hits, built {report.get('built', 0)}, "
          f"missing {len(missing)}, loaded {report.get('loaded', 'n/a (no GPU)' if not gpu else 0)}")
    for key in ("build_error", "load_error"):
        if key in report:
            print(f"{key}: {report[key]}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(build_main(sys.argv[1:]))
