"""The admission table (engine/core/admission_rules/) is the only place that refuses: every
`InvalidRequestError(...)` made in engine/ is made in the table, but for a short allow-list (scanned
on the source, so a rule written anywhere else fails here). Each rule's cases: test_admission.py."""

from __future__ import annotations

import ast

from tests.support.admission_cases import ENGINE, TABLE

# (file under engine/, function or "*": all of the file) -> why it may make an InvalidRequestError
# outside the table.
ALLOWED = {
    ("entrypoints/openai/request_body.py", "read_body"): "a malformed body: too many JSON values to parse",
    ("entrypoints/openai/request_body.py", "parse_body"): "a malformed body: a lone UTF-16 surrogate",
    ("entrypoints/openai/request_body.py", "bounded"): "a malformed body: not UTF-8, nested too deeply",
    ("lora/adapters.py", "load_lora"): "the adapter-management API (load), not a request to admit",
    ("lora/adapters.py", "unload_lora"): "the adapter-management API (unload), not a request to admit",
    ("lora/validate.py", "*"): "the adapter-management API: an adapter directory or name to load",
    ("runtime/async_engine.py", "_drain_inbox"): "a request that failed on the step thread, reported as refused",
}


def _refusals(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every call of InvalidRequestError (a subclass named *Error
    deriving from it would be listed by the class scan below)."""
    found = []

    def walk(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                f = child.func
                callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if callee in _REFUSAL_CLASSES:
                    found.append((name, child.lineno))
            walk(child, name)

    walk(tree, "<module>")
    return found


def _subclasses() -> set[str]:
    """InvalidRequestError and every class of engine/ deriving from it (by name, transitively)."""
    bases: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    names = {"InvalidRequestError"}
    while grown := {c for c, bs in bases.items() if bs & names} - names:
        names |= grown
    return names


_REFUSAL_CLASSES = _subclasses()


def test_only_the_table_refuses():
    sites, used = [], set()
    for path in sorted(ENGINE.rglob("*.py")):
        if path.parent == TABLE:
            continue
        rel = path.relative_to(ENGINE).as_posix()
        for fn, line in _refusals(ast.parse(path.read_text())):
            allowed = next((key for key in ((rel, fn), (rel, "*")) if key in ALLOWED), None)
            if allowed is not None:
                used.add(allowed)
            else:
                sites.append(f"engine/{rel}:{line} ({fn})")
    assert not sites, "refusals written outside engine/core/admission_rules/: " + ", ".join(sites)
    assert used == set(ALLOWED), f"allow-list entries with no refusal left: {set(ALLOWED) - used}"


def test_the_scan_finds_a_refusal_and_its_subclasses():
    tree = ast.parse("class E(InvalidRequestError): pass\ndef f():\n    raise errors.InvalidRequestError('x')\n")
    assert _refusals(tree) == [("f", 3)]
    assert {"InvalidRequestError"} <= _REFUSAL_CLASSES
