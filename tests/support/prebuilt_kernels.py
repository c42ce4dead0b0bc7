"""The package's prebuilt C++ CPU libraries (compiler/kernels/prebuilt/: `make venv` builds this
CPU's there, a wheel ships every ISA level's), pointed at another folder for a test.

A checkout that ran `make venv` holds them, and the loaders find them before any cache, so a test
of the runtime build (what a machine the install did not cover does) points the folder at an
empty one; a test of the install step's libraries points it at a folder holding copies."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from compiler.kernels import cpu_extension


@contextmanager
def prebuilt_dir(folder: Path) -> Iterator[Path]:
    """cpu_extension.SHIPPED_DIR is `folder` (created, empty unless the caller fills it) inside
    the block; a context manager, so a module-scoped fixture can hold it too."""
    folder.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_extension, "SHIPPED_DIR", folder)
        yield folder
