"""Every sm_90a kernel variant built with nvcc, in the background from the start of the session
(tests/compiler/test_kernel_build.py's `full_build`: ~3 min of CPU on 2 cores).

The build is a process of its own at the lowest priority (nice 19), so it runs on the core the
suite leaves idle, and the tests that read it run last (tests/conftest.py moves them): in the
whole suite they find it done; run alone they wait for it as before. Its own process also keeps
its nvcc command recorder away from the tests that patch or call the builder meanwhile.

    python -m tests.support.kernel_build CACHE REPORT   build into CACHE, write REPORT (JSON):
        {"commands": [every nvcc command line], "built": [{"name", "key", "cached"}]}
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = "full_build"  # the fixture that reads the build: its tests run after every other test


def uses_the_build(item) -> bool:
    return FIXTURE in getattr(item, "fixturenames", ())


@dataclass
class BackgroundBuild:
    cache: Path
    report: Path
    proc: subprocess.Popen

    def wait(self) -> tuple[Path, list[list[str]], list[dict]]:
        """(cache, nvcc commands, built variants) once the build has ended; its log if it failed."""
        rc = self.proc.wait()
        log = self.report.with_suffix(".log")
        assert rc == 0, f"the background kernel build failed (rc {rc}):\n{log.read_text()[-4000:]}"
        report = json.loads(self.report.read_text())
        return self.cache, report["commands"], report["built"]

    def stop(self) -> None:
        if self.proc.poll() is None:  # (a session cut short: nvcc's children go with it)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start(root: Path) -> BackgroundBuild:
    root.mkdir(parents=True, exist_ok=True)
    cache, report = root / "kernel-cache", root / "build.json"
    with open(report.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "tests.support.kernel_build", str(cache), str(report)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return BackgroundBuild(cache, report, proc)


def main(argv: list[str]) -> int:
    from compiler.kernels import build as kbuild

    cache, report = Path(argv[0]), Path(argv[1])
    commands: list[list[str]] = []
    real = kbuild._run_nvcc

    def recording(cmd):
        commands.append(cmd)
        return real(cmd)

    kbuild._run_nvcc = recording  # (this process builds nothing else)
    results = kbuild.build_kernels(cache, None, jobs=None, progress=False)
    built = [{"name": r.name, "key": r.key, "cached": r.cached} for r in results]
    report.write_text(json.dumps({"commands": commands, "built": built}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
