"""One benchmark process of a peer comparison (kiln or llama.cpp), run to its end and measured the
same way for every engine: its peak resident memory and when it was ready (issue 40: "as light as
llama.cpp").

Peak RSS is the kernel's high-water mark of the process's resident set (anonymous pages and the
file pages it has mapped and touched, so a memory-mapped model counts as much as a copied one), as
GNU time (/usr/bin/time -f %M) reads it from wait4() on the one child it forks. Not wait4() here:
a child exec'd from this process starts with this process's own high-water mark (the kernel keeps
the larger of the mm it leaves behind at exec), and getrusage(RUSAGE_CHILDREN) gives the largest of
every child so far. `taskset -c` execs the program, so the child measured is the engine itself.
Ready: seconds from the start to the first output line that `ready` accepts (stamped on arrival;
`ready` may return an earlier moment, e.g. the arrival less the run the line reports)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# ready(line, seconds since the start at its arrival) -> the ready time it shows, or None
ReadyRule = Callable[[str, float], "float | None"]
GNU_TIME = "/usr/bin/time"


@dataclass
class Measured:
    returncode: int
    stdout: str
    stderr: str
    peak_rss: int  # bytes
    ready_s: float | None  # None: no line said so
    wall_s: float


def run_measured(
    cmd: list[str],
    ready: ReadyRule | None = None,
    timeout: float | None = None,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
) -> Measured:
    """Run `cmd` to its end (killed after `timeout` seconds: TimeoutError), its output kept."""
    if not Path(GNU_TIME).is_file():
        raise SystemExit(f"{GNU_TIME} (GNU time) is needed to measure peak RSS (apt-get install time)")
    with tempfile.TemporaryDirectory(prefix="kiln-peer-") as tmp:
        report = Path(tmp) / "maxrss_kb"
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [GNU_TIME, "-f", "%M", "-o", str(report), *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,  # (a timeout stops GNU time and the engine together)
        )
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        marks: list[float] = []

        def pump(name: str, stream) -> None:
            for line in stream:
                at = time.perf_counter() - t0
                out[name].append(line)
                if ready is not None and not marks and (seen := ready(line, at)) is not None:
                    marks.append(seen)

        pumps = [threading.Thread(target=pump, args=(n, getattr(proc, n)), daemon=True) for n in out]
        for p in pumps:
            p.start()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{cmd[0]} ran past {timeout:.0f}s") from None
        wall = time.perf_counter() - t0
        for p in pumps:
            p.join(10)
        lines = report.read_text().split() if report.is_file() else []
        peak = int(lines[-1]) * 1024 if lines and lines[-1].isdigit() else 0
    return Measured(
        proc.returncode, "".join(out["stdout"]), "".join(out["stderr"]), peak, min(marks, default=None), wall
    )


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own arguments, those after `--`: passed as they are to every server it starts)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


# ---- the machine it ran on --------------------------------------------------------------------------------
def machine() -> str:
    """CPU model and the ISA extensions that matter here, from /proc/cpuinfo."""
    model, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("?", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [
        f
        for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
        if f in flags
    ]
    limits = [f"{k}={os.environ[k]}" for k in ("KILN_CPU_ISA", "LD_LIBRARY_PATH") if os.environ.get(k)]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa) or 'no AVX2'}" + (
        f" ({', '.join(limits)})" if limits else ""
    )


def load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"
