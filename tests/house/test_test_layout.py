"""The tests' own house rules: test modules live in a folder named for the package they test, and
share helpers through tests/support/ (and fixtures in conftest.py), never by importing each other."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {
    "bench",
    "compiler",
    "config",
    "core",
    "entrypoints",
    "executor",
    "house",
    "layers",
    "models",
    "runtime",
    "spec_decode",
    "worker",
}


def test_every_test_module_is_in_a_package_folder():
    modules = list(TESTS.rglob("test_*.py"))
    assert len(modules) > 90
    misplaced = [str(p.relative_to(TESTS)) for p in modules if p.parent.name not in FOLDERS or p.parent.parent != TESTS]
    assert not misplaced, misplaced


def imported_test_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        out += [n for n in names if n.split(".")[-1].startswith("test_") or n.split(".")[-1] == "conftest"]
    return out


def test_no_test_module_imports_another():
    found = {str(p.relative_to(TESTS)): imported_test_modules(p) for p in TESTS.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}, {k: v for k, v in found.items() if v}


def test_the_rule_sees_an_import(tmp_path):
    bad = tmp_path / "test_x.py"
    bad.write_text(
        "from tests.runtime.test_overlap import PROMPTS\nimport conftest\nfrom tests.support.engine import served\n"
    )
    assert imported_test_modules(bad) == ["tests.runtime.test_overlap", "conftest"]
