"""Build kiln's C++ CPU libraries at install, so no start compiles: `make venv` runs it for this
CPU into compiler/kernels/prebuilt/ (while pip installs what is not torch: it needs torch alone),
a wheel build with --all (setup.py's hook, compiler/kernels/wheel_build.py), and the wheel ships
them there; the loaders look there first
(compiler/kernels/cpu_extension.py: find_library). A library found there is not built again
into another folder either.

    kiln build-kernels --cpu [--all] [--jobs N]        (into kiln's compile cache)
    python -m compiler.kernels.cpu_prebuild --into DIR [--all] [--jobs N] [--manifest FILE]

`--manifest` writes where each library is (JSON: its path under a prebuilt folder -> the file), for
the wheel's build hook (compiler/kernels/wheel_build.py), which runs without torch and copies them.

The libraries: the paged attention and the fused element-wise ops, one build per torch CPU
capability (their flags follow it: DEFAULT, AVX2, AVX512 on x86-64), and the weight-streaming
kernels, one build holding every ISA level (each level under its own target pragma, picked at
run time). A library already there is not built again. Each build runs in its own process (a
process can load one library of an op namespace), `--jobs` at a time (one more than cores), and
prints one line when it ends: this is the visible install step the issue asks for (issue 40, item 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]

# torch's CPU capabilities kiln's per-capability libraries are built for (x86-64).
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


@dataclass(frozen=True)
class Job:
    kind: str  # "cpu-attention" | "cpu-fused" | "cpu-gemv"
    capability: str  # torch's CPU capability the flags follow ("every level": the gemv library)

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.capability})"


def _spec(job: Job) -> tuple[Path, list[str], str]:
    """(source, flags, cache key) of a job's library: the loaders' own (one definition each)."""
    from compiler.kernels import cpu_attention, cpu_fused, cpu_gemv

    cap = job.capability
    if job.kind == "cpu-attention":
        return cpu_attention.SOURCE, cpu_attention.cpu_flags(cap), cpu_attention.KERNEL.key(cap)
    if job.kind == "cpu-fused":
        return cpu_fused.SOURCE, cpu_fused.cpu_flags(cap), cpu_fused.FUSED.key(cap)
    return cpu_gemv.SOURCE, cpu_gemv.FLAGS, cpu_gemv.GEMV.key()


def jobs(every_level: bool) -> list[Job]:
    """Every library this CPU's starts load, or (every_level) every capability's on x86-64."""
    import platform

    import torch

    here = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    caps = X86_CAPABILITIES if every_level and x86 else (here,)
    per_cap = [Job(kind, cap) for cap in caps for kind in ("cpu-attention", "cpu-fused")]
    return [Job("cpu-gemv", "every level"), *per_cap]  # (the longest build first)


def library(job: Job, root: Path) -> Path:
    from compiler.kernels import cpu_extension

    return cpu_extension.library_path(root, job.kind, _spec(job)[2])


def built(job: Job, root: Path) -> Path | None:
    """Where the job's library already is: under `root`, or among the package's own (a wheel's, or
    an editable install's compiler/kernels/prebuilt/), which the loaders look in first."""
    from compiler.kernels import cpu_extension

    for where in (root, cpu_extension.SHIPPED_DIR):
        path = library(job, where)
        if path.is_file():
            return path
    return None


def manifest(root: Path, every_level: bool) -> dict[str, str]:
    """Each library built (under `root` or the package's folder): its path inside a prebuilt
    folder (<kind>/<name>/<name>.so, as the loaders look it up) -> where the file is now."""
    found = {job: built(job, root) for job in jobs(every_level)}
    return {path.relative_to(path.parents[2]).as_posix(): str(path) for path in found.values() if path is not None}


def build_one(job: Job, root: Path) -> None:
    """Build one library (in this process: it loads it, as torch's builder does)."""
    from compiler.kernels import cpu_extension

    source, flags, _ = _spec(job)
    cpu_extension.build(library(job, root), source, flags)


def default_workers(builds: int, cores: int | None = None) -> int:
    """One build more than cores: with a build per core, the short one (the fused ops, ~15 s) waited
    for a core and ran alone at the end (on 2 cores: 65 s + 16 s); beside the two long ones it
    shares the cores and all three end together, ~the CPU-seconds / 2."""
    return max(1, min(builds, (cores or os.cpu_count() or 1) + 1))


def prebuild(root: Path, every_level: bool = False, jobs_at_once: int | None = None, out=print) -> int:
    """Build what is missing under `root`; one line per library. Returns the number that failed."""
    todo = jobs(every_level)
    found = {j: built(j, root) for j in todo}
    missing = [j for j in todo if found[j] is None]
    for j in todo:
        if j not in missing:
            out(f"kiln CPU kernels: {j.label} already built ({found[j].parent})")
    if not missing:
        return 0
    workers = jobs_at_once or default_workers(len(missing))
    out(
        f"kiln CPU kernels: building {len(missing)} C++ libraries into {root} ({workers} at a time; "
        "a few minutes on 2 cores, once per install) ..."
    )

    def run(job: Job) -> tuple[Job, int, float, float, str]:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "compiler.kernels.cpu_prebuild", "--one", f"{job.kind}:{job.capability}"]
        # (from the folder above compiler/: a checkout's, a wheel build's or site-packages)
        proc = subprocess.run([*cmd, "--into", str(root)], capture_output=True, text=True, cwd=PACKAGE_ROOT)
        tail = (proc.stderr or proc.stdout)[-2000:]
        return job, proc.returncode, time.perf_counter() - t0, _cpu_seconds(proc.stdout), tail

    failed, cpu = 0, 0.0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        for done in as_completed([pool.submit(run, job) for job in missing]):  # (a line as each ends)
            job, rc, seconds, cpu_s, tail = done.result()
            cpu += cpu_s
            if rc == 0:
                out(f"kiln CPU kernels: {job.label} built in {seconds:.0f}s ({cpu_s:.0f} CPU-s)")
            else:
                failed += 1
                out(f"kiln CPU kernels: {job.label} FAILED after {seconds:.0f}s (a start compiles it instead):\n{tail}")
    out(f"kiln CPU kernels: {len(missing) - failed} built in {time.perf_counter() - t0:.0f}s, {cpu:.0f} CPU-s")
    return failed


_CPU_MARK = "kiln-build-cpu-seconds:"


def _cpu_seconds(stdout: str) -> float:
    """The CPU-seconds a child build reported (its own and its compilers'; 0 if it said none)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(_CPU_MARK):
            return float(line.removeprefix(_CPU_MARK))
    return 0.0


def _report_cpu_seconds() -> None:
    import resource

    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    print(f"{_CPU_MARK}{sum(u.ru_utime + u.ru_stime for u in used):.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compiler.kernels.cpu_prebuild", description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="every ISA level kiln dispatches to (a wheel), not this CPU's")
    p.add_argument("--into", type=Path, required=True, help="the compile cache (kiln build-kernels --cpu: kiln's)")
    p.add_argument("--jobs", type=int, default=None, help="builds at once (default: the CPU count + 1)")
    p.add_argument("--manifest", type=Path, default=None, help="write the built libraries' paths here (JSON)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # KIND:CAPABILITY, in a child process
    args = p.parse_args(argv)
    root = args.into.expanduser()
    if args.one:
        kind, _, capability = args.one.partition(":")
        build_one(Job(kind, capability), root)
        _report_cpu_seconds()  # (the compilers ran as this process's waited-for children)
        return 0
    failed = prebuild(root, args.all, args.jobs)
    if args.manifest is not None:
        args.manifest.write_text(json.dumps(manifest(root, args.all), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
