"""The one-way imports the design asks for, checked on the source: compiler/ never imports
engine/, and neither the benchmarks nor the server import the CLI that registers them (so
`engine.cli` can import them without a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _offenders(folder: str, forbidden) -> list[str]:
    return [f"{p.relative_to(REPO)} imports {name}" for p in sorted((REPO / folder).rglob("*.py"))
            for name in sorted(_imports(p)) if forbidden(name)]


def test_compiler_does_not_import_engine():
    assert _offenders("compiler", lambda n: n == "engine" or n.startswith("engine.")) == []


def test_benchmarks_and_server_do_not_import_the_cli():
    for folder in ("engine/bench", "engine/server"):
        assert _offenders(folder, lambda n: n == "engine.cli") == []
