"""`kiln build-kernels [--variants a,b] [--jobs N] [--cache-dir DIR] [--list | --check [--no-build] [--json F]]
[--prune]`.

--check: which variants the loader finds in the cache (a hit needs no nvcc), build only the
missing or stale ones (where nvcc is), and with a GPU load every cubin into it
(tools/gpu_check.sh's kernel-cache stage). Exit 0 only if every variant is there and loads.
--check --no-build: the same report, building nothing (no nvcc, no GPU): run it here before a
device call, so the carried cache is known to match the templates.
--prune: delete what the index does not refer to (objects of older template versions, failed
sources, interrupted builds) and index entries of variants no longer in the manifest: the
cache then holds exactly what the loader reads, and travels at its smallest.

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
    p.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"kernel cache (default {DEFAULT_CACHE_DIR})"
    )
    p.add_argument("--list", action="store_true", help="list the variants and whether they are built; build nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--check",
        action="store_true",
        help="report cache hits, build only what is missing, load every cubin where a GPU is",
    )
    p.add_argument("--no-build", action="store_true", help="--check: build nothing, only report (exit 1 on a miss)")
    p.add_argument(
        "--prune",
        action="store_true",
        help="delete cache entries the index does not refer to (after building or checking)",
    )
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
        rc = _check([v.name for v in variants], cache_dir, args)
        return rc if not args.prune else max(rc, _prune(cache_dir, manifest))
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
    if args.prune:
        _prune(cache_dir, manifest)
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
    if missing and find_nvcc() is not None and not args.no_build:
        try:
            results = build_kernels(cache_dir, missing, jobs=args.jobs, progress=False)
            report["built"] = sum(not r.cached for r in results)
        except Exception as e:  # noqa: BLE001 - reported, the check fails
            report["build_error"] = str(e)[:2000]
        missing = missing_variants(cache_dir, names)
    report["still_missing"] = missing
    report.update(_cache_size(cache_dir))
    ok = not missing
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu and ok and not args.no_build:
        try:
            KernelLibrary(cache_dir, names).load("cuda")
            report["loaded"] = len(names)
        except Exception as e:  # noqa: BLE001 - reported, the check fails
            report["load_error"] = str(e)[:2000]
            ok = False
    loaded = report.get("loaded", "n/a (--no-build)" if args.no_build else "n/a (no GPU)" if not gpu else 0)
    print(
        f"kernel cache {cache_dir}: {report['hits']}/{len(names)} hits, built {report.get('built', 0)}, "
        f"missing {len(missing)}, loaded {loaded}; the index's cubins {report['cubin_bytes'] / 2**20:.1f} MiB, "
        f"the whole cache {report['cache_bytes'] / 2**20:.1f} MiB ({report['unreferenced_objects']} objects "
        "the index does not refer to: --prune)"
    )
    if missing:
        print(f"missing or stale (templates changed since the build): {', '.join(missing)}")
    for key in ("build_error", "load_error"):
        if key in report:
            print(f"{key}: {report[key]}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


def _cache_size(cache_dir: Path) -> dict:
    """Bytes of the cubins the index refers to, of the whole cache, and objects it does not refer to."""
    from compiler.kernels.build import read_index

    index = read_index(cache_dir)
    cubins = [cache_dir / rec["cubin"] for rec in index.values()]
    used = {p.parent for p in cubins}
    objects = [d for d in (cache_dir / "objects").glob("*/*") if d.is_dir()] if (cache_dir / "objects").is_dir() else []
    total = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) if cache_dir.is_dir() else 0
    return {
        "cubin_bytes": sum(p.stat().st_size for p in cubins if p.exists()),
        "cache_bytes": total,
        "unreferenced_objects": sum(d not in used for d in objects),
    }


def _prune(cache_dir: Path, manifest) -> int:
    """Keep only what the index refers to, for variants still in the manifest."""
    import json
    import shutil

    from compiler.kernels.build import INDEX_NAME, read_index

    if not cache_dir.is_dir():
        print(f"kernel cache {cache_dir}: nothing to prune (no such directory)")
        return 0
    before = _cache_size(cache_dir)["cache_bytes"]
    index = read_index(cache_dir)
    kept = {name: rec for name, rec in index.items() if name in manifest}
    if kept != index:
        (cache_dir / INDEX_NAME).write_text(json.dumps(kept, indent=1, sort_keys=True))
    used = {(cache_dir / rec["cubin"]).parent for rec in kept.values()}
    removed = 0
    for d in list((cache_dir / "objects").glob("*/*")) if (cache_dir / "objects").is_dir() else []:
        if d.is_dir() and d not in used:  # (also `.<key>.` temporary directories of interrupted builds)
            shutil.rmtree(d)
            removed += 1
    for d in (cache_dir / "objects").glob("*") if (cache_dir / "objects").is_dir() else []:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    shutil.rmtree(cache_dir / "failed", ignore_errors=True)
    after = _cache_size(cache_dir)["cache_bytes"]
    print(
        f"pruned {cache_dir}: {removed} objects and {len(index) - len(kept)} index entries removed, "
        f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(build_main(sys.argv[1:]))
