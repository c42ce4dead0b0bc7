"""Ahead-of-time kernel build: render templates, run nvcc in parallel, cache by content.

Cache layout (cache_dir, e.g. ~/.cache/kiln/kernels):
  objects/<key[:2]>/<key>/kernel.cu     the rendered source that was compiled
  objects/<key[:2]>/<key>/kernel.cubin  the cubin (sm_90a)
  objects/<key[:2]>/<key>/ptxas.txt     nvcc/ptxas `-Xptxas -v` report (see parse_ptxas_report)
  objects/<key[:2]>/<key>/meta.json     variant, params, flags, nvcc version, resources
  index.json                            {variant name: record}: what the loader reads; it needs
                                        no nvcc (serving machines may have none)
key = sha256(source_hash + nvcc version); source_hash = sha256(rendered text + parameters +
arch + flags), so the loader can tell a stale cubin (templates changed) without nvcc.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from compiler.kernels.manifest import Variant, load_manifest, render, select_variants

ARCH = "sm_90a"
NVCC_FLAGS = (
    "-cubin",
    "-gencode",
    "arch=compute_90a,code=sm_90a",
    "-O3",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-std=c++17",
    "-Xptxas",
    "-v",
)
INDEX_NAME = "index.json"
_index_lock = threading.Lock()


class KernelBuildError(RuntimeError):
    """nvcc failed on a variant; carries the variant's name and nvcc's message."""

    def __init__(self, variant: str, message: str, source_path: Path | None = None):
        self.variant = variant
        self.message = message
        self.source_path = source_path
        where = f" (source kept at {source_path})" if source_path else ""
        super().__init__(f"kernel variant {variant!r} failed to compile{where}:\n{message}")


class NvccNotFoundError(RuntimeError):
    pass


@dataclass
class FunctionResources:
    registers: int = 0
    shared_bytes: int = 0  # static shared memory
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0


@dataclass
class BuildResult:
    name: str
    key: str
    cubin: Path
    cached: bool
    seconds: float
    resources: dict[str, FunctionResources] = field(default_factory=dict)

    @property
    def functions(self) -> list[str]:
        return list(self.resources)


# --- toolchain ----------------------------------------------------------------------


def find_nvcc(nvcc: str | os.PathLike | None = None) -> str | None:
    if nvcc is not None:
        return str(nvcc) if Path(nvcc).exists() or shutil.which(str(nvcc)) else None
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if Path(cand).exists():
            return cand
    return None


_version_cache: dict[str, str] = {}


def nvcc_version(nvcc: str) -> str:
    if nvcc not in _version_cache:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
        _version_cache[nvcc] = " | ".join(lines[-2:])
    return _version_cache[nvcc]


# A rendered source that includes a CUTLASS or CuTe header. Only those get the nvidia-cutlass include
# path: the others build wherever nvcc is (the GPU machine has nvcc but no nvidia-cutlass).
_CUTLASS_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"](?:cute|cutlass)/', re.M)


def needs_cutlass(text: str) -> bool:
    """The rendered kernel source includes CUTLASS/CuTe headers."""
    return _CUTLASS_INCLUDE.search(text) is not None


def cutlass_include_dir() -> Path:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise NvccNotFoundError("the nvidia-cutlass package (cutlass_library) is not installed")
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    if not (inc / "cute").is_dir():
        raise NvccNotFoundError(f"CUTLASS headers not found under {inc}")
    return inc


# --- hashing ------------------------------------------------------------------------


def source_hash(variant: Variant, text: str, arch: str = ARCH, flags=NVCC_FLAGS) -> str:
    payload = json.dumps(
        {
            "text": text,
            "name": variant.name,
            "kind": variant.kind,
            "params": [[k, v] for k, v in variant.params],
            "arch": arch,
            "flags": list(flags),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def build_key(src_hash: str, nvcc_ver: str) -> str:
    return hashlib.sha256(f"{src_hash}\n{nvcc_ver}".encode()).hexdigest()


# --- ptxas report -------------------------------------------------------------------

_RE_ENTRY = re.compile(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_][\w$]*)'?")
_RE_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_BAR = re.compile(r"used (\d+) barriers")


def parse_ptxas_report(text: str) -> dict[str, FunctionResources]:
    """Per-function registers / static smem / stack / spills from `-Xptxas -v` output."""
    res: dict[str, FunctionResources] = {}
    current = None
    for line in text.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            current = m.group(1)
            res.setdefault(current, FunctionResources())
            continue
        if current is None:
            continue
        r = res[current]
        if m := _RE_STACK.search(line):
            r.stack_bytes, r.spill_stores, r.spill_loads = (int(x) for x in m.groups())
        if m := _RE_USED.search(line):
            r.registers = int(m.group(1))
            if s := _RE_SMEM.search(line):
                r.shared_bytes = int(s.group(1))
            if b := _RE_BAR.search(line):
                r.barriers = int(b.group(1))
    return res


def _resources_to_json(res: dict[str, FunctionResources]) -> dict:
    return {k: vars(v) for k, v in res.items()}


def resources_from_json(d: dict) -> dict[str, FunctionResources]:
    return {k: FunctionResources(**v) for k, v in d.items()}


# --- index --------------------------------------------------------------------------


def read_index(cache_dir: Path) -> dict:
    p = Path(cache_dir) / INDEX_NAME
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _update_index(cache_dir: Path, records: dict) -> None:
    with _index_lock:
        idx = read_index(cache_dir)
        idx.update(records)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".index.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(idx, f, indent=1, sort_keys=True)
        os.replace(tmp, Path(cache_dir) / INDEX_NAME)


# --- build --------------------------------------------------------------------------


def object_dir(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "objects" / key[:2] / key


def _run_nvcc(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def build_variant(
    variant: Variant, cache_dir: Path, nvcc: str, templates_dir: Path | None = None, extra_flags: tuple[str, ...] = ()
) -> BuildResult:
    cache_dir = Path(cache_dir)
    t0 = time.perf_counter()
    flags = NVCC_FLAGS + tuple(extra_flags)
    text = render(variant, templates_dir)
    src_h = source_hash(variant, text, ARCH, flags)
    ver = nvcc_version(nvcc)
    key = build_key(src_h, ver)
    odir = object_dir(cache_dir, key)
    cubin = odir / "kernel.cubin"
    meta_path = odir / "meta.json"
    if cubin.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        res = resources_from_json(meta["resources"])
        return BuildResult(variant.name, key, cubin, True, time.perf_counter() - t0, res)

    includes = [f"-I{cutlass_include_dir()}"] if needs_cutlass(text) else []  # (raises without nvidia-cutlass)
    odir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=odir.parent, prefix=f".{key[:12]}."))
    src = work / "kernel.cu"
    src.write_text(text)
    cmd = [nvcc, *flags, *includes, "-o", str(work / "kernel.cubin"), str(src)]
    proc = _run_nvcc(cmd)
    report = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        kept = cache_dir / "failed" / f"{variant.name}.cu"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, kept)
        shutil.rmtree(work, ignore_errors=True)
        msg = "\n".join(ln for ln in report.splitlines() if "ptxas info" not in ln) or report
        raise KernelBuildError(variant.name, msg.strip(), kept)
    (work / "ptxas.txt").write_text(report)
    res = parse_ptxas_report(report)
    meta = {
        "variant": variant.name,
        "kind": variant.kind,
        "params": dict(variant.params),
        "source_hash": src_h,
        "key": key,
        "nvcc_version": ver,
        "arch": ARCH,
        "flags": list(flags),
        "resources": _resources_to_json(res),
        "compile_seconds": round(time.perf_counter() - t0, 2),
    }
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.rename(work, odir)
    except OSError:  # another builder won the race: keep theirs
        shutil.rmtree(work, ignore_errors=True)
    return BuildResult(variant.name, key, cubin, False, time.perf_counter() - t0, res)


def _index_record(cache_dir: Path, variant: Variant, r: BuildResult, src_h: str) -> dict:
    return {
        "key": r.key,
        "source_hash": src_h,
        "cubin": str(r.cubin.relative_to(cache_dir)),
        "kind": variant.kind,
        "params": dict(variant.params),
        "functions": r.functions,
        "resources": _resources_to_json(r.resources),
    }


def build_kernels(
    cache_dir,
    variants=None,
    jobs: int | None = None,
    progress: bool = True,
    nvcc: str | None = None,
    templates_dir: Path | None = None,
    manifest: dict[str, Variant] | None = None,
) -> list[BuildResult]:
    """Build `variants` (names or Variant objects; None = the whole manifest) into cache_dir.

    Cached variants cost no nvcc call. Raises KernelBuildError (variant name + nvcc's
    message) on the first failure, after the other jobs finish; NvccNotFoundError without nvcc.
    """
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    nvcc_path = find_nvcc(nvcc)
    if nvcc_path is None:
        raise NvccNotFoundError("nvcc not found on PATH: kernels can only be built where the CUDA toolkit is installed")
    if variants is None:
        vlist = list((manifest or load_manifest()).values())
    else:
        vlist = [v if isinstance(v, Variant) else None for v in variants]
        if any(v is None for v in vlist):
            names = [v for v in variants if not isinstance(v, Variant)]
            by_name = {v.name: v for v in select_variants(names, manifest)}
            vlist = [v if isinstance(v, Variant) else by_name[v] for v in variants]
    jobs = max(1, jobs or os.cpu_count() or 1)

    results: dict[str, BuildResult] = {}
    errors: list[BaseException] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(vlist), desc="kiln build-kernels", unit="variant")

    def one(v: Variant):
        try:
            r = build_variant(v, cache_dir, nvcc_path, templates_dir)
            text = render(v, templates_dir)
            rec = _index_record(cache_dir, v, r, source_hash(v, text))
            _update_index(cache_dir, {v.name: rec})
            results[v.name] = r
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
        finally:
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(v.name)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, vlist))
    if bar is not None:
        bar.close()
    if errors:
        raise errors[0]
    return [results[v.name] for v in vlist]
