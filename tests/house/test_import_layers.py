"""The house rules of the layout, checked on the source (every import counts: module level, inside a
function, or under TYPE_CHECKING):

- no import circles anywhere in engine/ and compiler/;
- compiler/ never imports engine/;
- engine/core/ imports neither torch nor the worker (and nothing above it);
- the scheduler's side of speculative decoding (engine/spec_decode/sched/) imports neither torch
  nor the worker either;
- the device side (worker, device proposers, executor, model) imports of the core only the step's
  message and the plain values in it, nothing that holds or changes the core's state;
- engine/layers/ never imports engine/models/;
- each package imports only the packages below it (ALLOWED), and inside the runtime only the
  builder sees the model, its layers and the executor;
- neither the benchmarks nor the server import the CLI that registers them;
- only engine/config reads or writes the process environment.

Each rule's checker is also run on a small broken tree, so a rule that could not fail is caught.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Package -> the packages of engine/ (and compiler) it may import. "engine" is engine/__init__.py.
ALLOWED = {
    "core": set(),
    "config": {"core"},
    "structured_output": {"config", "core"},  # (config: its compile processes' environment)
    "lora": {"core", "models"},
    "layers": {"compiler", "distributed"},  # (distributed: row-parallel o_proj / down_proj, the MoE all-reduce)
    "distributed": set(),
    "models": {"compiler", "layers", "distributed"},
    # (spec_decode: the sampler accepts drafts with its rejection.py, the runner keeps a verify's outcome
    # with its verify.py; module by module neither side imports back)
    "worker": {"compiler", "config", "core", "layers", "lora", "spec_decode", "structured_output"},
    # The scheduler's side of speculative decoding: plain Python over the core's sequences.
    "spec_decode.sched": {"core"},
    # The device side: proposers that drive the worker's runner and sampler.
    "spec_decode": {"core", "spec_decode.sched", "worker"},
    "training": {"layers", "models"},  # (offline: `kiln make-draft-model`)
    "executor": {"compiler", "config", "distributed", "layers", "models", "worker"},
    # What to build (model directory, device, dtype, the CPU's KV budget): decisions read off the settings,
    # the model's config and the machine, made before the builder assembles anything.
    "resolve": {"config", "core", "layers", "models", "worker"},
    "runtime": {
        "compiler",
        "config",
        "core",
        "executor",
        "layers",
        "lora",
        "models",
        "resolve",
        "spec_decode",
        "spec_decode.sched",
        "structured_output",
        "worker",
    },
    "entrypoints": {"compiler", "config", "core", "lora", "models", "runtime", "structured_output", "training"},
    "bench": {"compiler", "config", "core", "engine", "entrypoints", "executor", "models", "runtime", "worker"},
    "engine": {"config", "core", "entrypoints"},
}
# Inside the runtime, only the builder (and its parts: builder_*.py) assembles the model side.
BUILDER_ONLY = {"layers", "models", "executor", "spec_decode"}
BUILDER = "engine.runtime.builder"
# The device side's packages, and what of engine/core they may import: the step's plain message
# (SchedulerOutput, the runner's SamplerOutput) and the values it carries, never the scheduler, the
# block pool, the allocator or a Sequence (engine/core/sched/scheduler_output.py: the worker keeps
# its own copies, engine/worker/seq_states.py).
DEVICE_SIDE = {"worker", "spec_decode", "executor", "layers", "models", "distributed"}
CORE_MESSAGES = {
    "engine.core.params",
    "engine.core.outputs",
    "engine.core.request_kinds",
    "engine.core.sched.scheduler_output",
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, folders=("engine", "compiler")) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (a name imported from a package that is a
    submodule counts as that submodule)."""
    files = {module_name(p, root): p for folder in folders for p in (root / folder).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                hit = resolve(t)
                if hit and hit != mod:
                    graph[mod].add(hit)
    return graph


def external_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "compiler":
        return "compiler"
    if parts[0] != "engine":
        return None
    if parts[1:3] == ["spec_decode", "sched"]:
        return "spec_decode.sched"  # (a narrower rule than the device side's)
    return parts[1] if len(parts) > 1 else "engine"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        pkg = package_of(mod)
        if pkg is None or pkg == "compiler":
            continue
        for dep in sorted(deps):
            dpkg = package_of(dep)
            if dpkg is None or dpkg == pkg:
                continue
            if dpkg not in ALLOWED[pkg]:
                bad.append(f"{mod} imports {dep} ({pkg} may not import {dpkg})")
            elif pkg == "runtime" and dpkg in BUILDER_ONLY and not (mod == BUILDER or mod.startswith(BUILDER + "_")):
                bad.append(f"{mod} imports {dep} (only {BUILDER} assembles {dpkg})")
    return bad


def device_core_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the core's state (anything of engine/core but CORE_MESSAGES) by the device side."""
    return [
        f"{m} -> {d}"
        for m, ds in sorted(graph.items())
        if package_of(m) in DEVICE_SIDE
        for d in sorted(ds)
        if d.startswith("engine.core") and d not in CORE_MESSAGES
    ]


def torch_importers(root: Path, folder: str) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in sorted((root / folder).rglob("*.py"))
        if any(n == "torch" or n.startswith("torch.") for n in external_imports(p))
    ]


def spec_sched_violations(root: Path) -> list[str]:
    """What under engine/spec_decode/sched/ imports torch or the worker (the scheduler's side of
    speculative decoding runs with the core, without either)."""
    bad = torch_importers(root, "engine/spec_decode/sched")
    bad += [
        f"{m} -> {d}"
        for m, ds in sorted(import_graph(root).items())
        if m.startswith("engine.spec_decode.sched")
        for d in sorted(ds)
        if d.startswith("engine.worker")
    ]
    return bad


def environment_readers(root: Path, folders=("engine", "compiler")) -> list[str]:
    """Files outside engine/config that read or write the process environment (os.environ,
    os.getenv / putenv / unsetenv, or those names imported from os)."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).parts[:2] == ("engine", "config"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in names
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "os"
                ) or (
                    isinstance(node, ast.ImportFrom)
                    and node.module == "os"
                    and any(a.name in names for a in node.names)
                ):
                    found.append(str(path.relative_to(root)))
                    break
    return found


# ---- the rules on kiln's tree ----


def test_only_config_touches_the_environment():
    """Settings are read in one place: nothing outside engine/config reads or writes os.environ
    (a child process's environment comes from engine/config/process_env.py)."""
    assert environment_readers(REPO) == []


def test_no_import_circles():
    assert cycles(import_graph(REPO)) == []


def test_every_package_has_a_rule():
    packages = {package_of(m) for m in import_graph(REPO)} - {None, "compiler"}
    assert packages == set(ALLOWED), "a new package needs its line in ALLOWED"


def test_packages_import_only_downwards():
    assert layer_violations(import_graph(REPO)) == []


def test_compiler_does_not_import_engine():
    graph = import_graph(REPO)
    assert [
        f"{m} -> {d}" for m, ds in graph.items() if m.startswith("compiler") for d in ds if d.startswith("engine")
    ] == []


def test_core_imports_no_torch_and_no_worker():
    assert torch_importers(REPO, "engine/core") == []
    graph = import_graph(REPO)
    assert [
        f"{m} -> {d}"
        for m, ds in graph.items()
        if m.startswith("engine.core")
        for d in ds
        if not d.startswith("engine.core")
    ] == []


def test_spec_decode_sched_imports_no_torch_and_no_worker():
    assert spec_sched_violations(REPO) == []


def test_the_device_side_imports_only_the_cores_messages():
    assert device_core_imports(import_graph(REPO)) == []


def test_core_runs_without_loading_torch():
    """Importing the scheduler, the block pool, the request kinds and the scheduler's side of
    speculative decoding loads no torch (a fresh process)."""
    code = (
        "import sys; import engine.core.sched.scheduler, engine.core.kv.allocator, engine.core.request_kinds, "
        "engine.core.kv.swap_space, engine.spec_decode.sched; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_layers_never_import_models():
    graph = import_graph(REPO)
    assert [
        f"{m} -> {d}"
        for m, ds in graph.items()
        if m.startswith("engine.layers")
        for d in ds
        if d.startswith("engine.models")
    ] == []


def test_benchmarks_and_server_do_not_import_the_cli():
    graph = import_graph(REPO)
    assert [
        f"{m} -> {d}"
        for m, ds in graph.items()
        if m.startswith(("engine.bench", "engine.entrypoints.openai"))
        for d in ds
        if d == "engine.entrypoints.cli.main"
    ] == []


# ---- the checkers fail on a broken tree ----


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in ("engine", "compiler"):
        (tmp_path / d).mkdir(exist_ok=True)
    return tmp_path


def test_checkers_find_a_circle_and_a_wrong_way_import(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/core/__init__.py": "",
            "engine/core/a.py": "from engine.core import b\n",
            "engine/core/b.py": "def f():\n    from engine.core.a import x\n",  # (lazy: still a circle)
            "engine/core/c.py": "import torch\nfrom engine.worker.runner import R\n",
            "engine/worker/__init__.py": "",
            "engine/worker/runner.py": "R = 1\n",
            "engine/layers/__init__.py": "",
            "engine/layers/l.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.models.m import M\n"
            ),
            "engine/models/__init__.py": "",
            "engine/models/m.py": "M = 1\n",
            "engine/runtime/__init__.py": "",
            "engine/runtime/loop.py": "from engine.models.m import M\n",
        },
    )
    graph = import_graph(root)
    assert cycles(graph) == [["engine.core.a", "engine.core.b"]]
    bad = layer_violations(graph)
    assert any("engine.core.c imports engine.worker.runner" in b for b in bad)
    assert any("engine.layers.l imports engine.models.m" in b for b in bad)
    assert any("only engine.runtime.builder assembles models" in b for b in bad)
    assert torch_importers(root, "engine/core") == ["engine/core/c.py"]


def test_spec_sched_checker_finds_torch_and_the_worker(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/worker/__init__.py": "",
            "engine/worker/runner.py": "R = 1\n",
            "engine/spec_decode/__init__.py": "",
            # (the device side: fine)
            "engine/spec_decode/proposer.py": "import torch\nfrom engine.worker.runner import R\n",
            "engine/spec_decode/sched/__init__.py": "",
            "engine/spec_decode/sched/a.py": "import torch.nn\n",
            "engine/spec_decode/sched/b.py": "def f():\n    from ...worker import runner\n",
            "engine/spec_decode/sched/c.py": "from engine.spec_decode.proposer import P\n",
        },
    )
    assert spec_sched_violations(root) == [
        "engine/spec_decode/sched/a.py",
        "engine.spec_decode.sched.b -> engine.worker.runner",
    ]
    assert layer_violations(import_graph(root)) == [
        "engine.spec_decode.sched.b imports engine.worker.runner (spec_decode.sched may not import worker)",
        "engine.spec_decode.sched.c imports engine.spec_decode.proposer (spec_decode.sched may not import spec_decode)",
    ]


def test_device_side_checker_finds_an_import_of_core_state(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/core/__init__.py": "",
            "engine/core/params.py": "",
            "engine/core/request.py": "",
            "engine/core/sched/__init__.py": "",
            "engine/core/sched/scheduler.py": "",
            "engine/core/sched/scheduler_output.py": "",
            "engine/worker/__init__.py": "",
            "engine/worker/ok.py": "from engine.core.params import P\nfrom engine.core.sched import scheduler_output\n",
            "engine/worker/bad.py": "def f():\n    from engine.core.sched.scheduler import Scheduler\n",
            "engine/spec_decode/__init__.py": "",
            "engine/spec_decode/eagle.py": "from engine.core.request import Sequence\n",
            "engine/spec_decode/sched/__init__.py": "",
            # (the core's side: fine)
            "engine/spec_decode/sched/ngram.py": "from engine.core.request import Sequence\n",
        },
    )
    assert device_core_imports(import_graph(root)) == [
        "engine.spec_decode.eagle -> engine.core.request",
        "engine.worker.bad -> engine.core.sched.scheduler",
    ]


def test_environment_checker_finds_a_reader(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engine/config/settings.py": "import os\nX = os.environ.get('KILN_X')\n",
            "engine/worker/a.py": "import os\nenv = {**os.environ, 'OMP_NUM_THREADS': '1'}\n",
            "engine/worker/b.py": "from os import getenv\n",
            "compiler/c.py": "import os\nos.putenv('A', '1')\n",
            "engine/worker/d.py": "import os\nos.path.join('a', 'b')\n",
        },
    )
    assert environment_readers(root) == ["engine/worker/a.py", "engine/worker/b.py", "compiler/c.py"]
