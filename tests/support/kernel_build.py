"""Every sm_90a kernel variant built with nvcc, in the background from the start of the session
(tests/compiler/test_kernel_build.py's `full_build`: ~3 min of CPU on 2 cores).

The build is a process of its own whose nvcc runs at the lowest priority (nice 19), so it uses
the core the suite leaves idle, and the tests that read it run last (tests/conftest.py moves them):
in the whole suite they find it done. Once a test waits for it (run alone, or the build is late),
the nvcc jobs it starts from then on run at normal priority. Its own process also keeps its nvcc
command recorder away from the tests that patch or call the builder meanwhile.

    python -m tests.support.kernel_build CACHE REPORT HURRY   build into CACHE, write REPORT (JSON):
        {"commands": [every nvcc command line], "built": [{"name", "key", "cached"}]};
        nvcc niced until the file HURRY exists
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
    hurry: Path
    proc: subprocess.Popen

    def wait(self) -> tuple[Path, list[list[str]], list[dict]]:
        """(cache, nvcc commands, built variants) once the build has ended; its log if it failed."""
        self.hurry.touch()  # a test waits now: no more niced nvcc
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
    cache, report, hurry = root / "kernel-cache", root / "build.json", root / "hurry"
    with open(report.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.kernel_build", str(cache), str(report), str(hurry)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return BackgroundBuild(cache, report, hurry, proc)


def main(argv: list[str]) -> int:
    from compiler.kernels import build as kbuild

    cache, report, hurry = Path(argv[0]), Path(argv[1]), Path(argv[2])
    commands: list[list[str]] = []
    real = kbuild._run_nvcc

    def recording(cmd):
        commands.append(cmd)
        return real(cmd if hurry.exists() else ["nice", "-n", "19", *cmd])

    kbuild._run_nvcc = recording  # (this process builds nothing else)
    results = kbuild.build_kernels(cache, None, jobs=None, progress=False)
    built = [{"name": r.name, "key": r.key, "cached": r.cached} for r in results]
    report.write_text(json.dumps({"commands": commands, "built": built}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
