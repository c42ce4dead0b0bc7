"""Shared fixtures: tiny checkpoints made once per session, and engines checked after use."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import kernel_build
from tests.support.engine import ARCHS, assert_engine_clean

# Under tools/gpu_check.sh (KILN_GPU_CHECK_STRICT=1) a skipped GPU test is a failure, and so is a
# test module that skips as a whole (a missing GPU, kernel cache or cuda-python): on the device a
# skip means the check did not happen, and must not read as a pass.
STRICT_GPU = os.environ.get("KILN_GPU_CHECK_STRICT") == "1"


def pytest_collection_modifyitems(config, items):
    # the tests that read the nvcc build of every kernel variant run last: by then the build, started
    # in the background at the session's start, is done (tests/support/kernel_build.py)
    items.sort(key=kernel_build.uses_the_build)  # (stable: every other test keeps its order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not any node named "gpu"
            item.add_marker(skip)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT_GPU and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu"):
        report.outcome = "failed"
        report.longrepr = f"KILN_GPU_CHECK_STRICT: a GPU test skipped ({_skip_reason(report)})"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if STRICT_GPU and report.skipped and isinstance(collector, pytest.Module):
        report.outcome = "failed"
        report.longrepr = f"KILN_GPU_CHECK_STRICT: test module {collector.name} skipped ({_skip_reason(report)})"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """arch -> directory of a tiny random HF checkpoint (float32) with a locally trained tokenizer."""
    from engine.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=1 + i) for i, arch in enumerate(ARCHS)}


TRAIN_STEPS = 500


@pytest.fixture(scope="session")
def trained_tiny_model(tmp_path_factory):
    """arch -> a tiny checkpoint trained TRAIN_STEPS steps on the tokenizer's corpus
    (engine/models/tiny_model.py train_on_corpus): peaked next-token distributions that depend on
    attention, for fidelity gates. Each arch is trained on first use, once per session."""
    from engine.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("trained-tiny-models")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(root / arch, arch=arch, seed=1, train_steps=TRAIN_STEPS)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def kiln_cache_dir(tmp_path_factory) -> Path:
    """The session's kiln cache: every test's KILN_CACHE_DIR, holding the installed CPU libraries
    (a test's subprocess given another cache compiles them again: a minute or more)."""
    return tmp_path_factory.getbasetemp() / "kiln-cache"


@pytest.fixture(scope="session", autouse=True)
def _installed_cpu_libraries(kiln_cache_dir):
    """The C++ CPU libraries the install step built (`make venv`: the package's prebuilt folder;
    `kiln build-kernels --cpu`: kiln's cache) copied into the session's cache, so the tests that
    hide the prebuilt folder (of the runtime build: tests/support/prebuilt_kernels.py) do not
    compile them again in every pytest run (1-2 min on 2 cores). Their folder names hash the
    source, flags, torch version and ISA, so a copy is never stale: a changed kernel has a new
    name and is built as before."""
    from compiler.kernels.cpu_extension import SHIPPED_DIR
    from engine.config.settings_base import default_cache_dir

    session = kiln_cache_dir / "compile"
    for installed in (SHIPPED_DIR, default_cache_dir() / "compile"):
        for library in installed.glob("cpu-*/kiln_*/kiln_*.so"):
            copy = session / library.relative_to(installed)
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(library, copy)


@pytest.fixture(scope="session", autouse=True)
def kernel_build_in_background(request, tmp_path_factory):
    """The nvcc build of every kernel variant, started with the session when a collected test reads
    it (and nvcc is here), niced onto the idle core; None otherwise. Stopped if the session ends first."""
    from compiler.kernels.build import find_nvcc

    if find_nvcc() is None or not any(kernel_build.uses_the_build(item) for item in request.session.items):
        yield None
        return
    build = kernel_build.start(tmp_path_factory.mktemp("sm90-build"))
    yield build
    build.stop()


@pytest.fixture(autouse=True)
def _isolated_cache_dir(kiln_cache_dir, monkeypatch):
    """Keep tests out of the user's ~/.cache/kiln (the default model is made once per session)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(kiln_cache_dir))
    yield


@pytest.fixture
def make_llm(tiny_llama):
    """Build LLMs (default: tiny llama, float32 CPU, eager) and check each one's pool at teardown."""
    from engine.entrypoints.llm import LLM

    made = []

    def _make(model: Path | str | None = None, **settings):
        settings.setdefault("enforce_eager", True)
        settings.setdefault("device", "cpu")
        # Quantised layers of float32 models on the exact float path, whatever the CPU (auto takes
        # int8 activations without AVX-512): tests compare them with dequantised references token
        # for token; the int8 path's tests ask for it (or for a bf16 model).
        settings.setdefault("cpu_quant_activations", "float")
        llm = LLM(str(model or tiny_llama), **settings)
        made.append(llm)
        return llm

    yield _make
    for llm in made:
        assert_engine_clean(llm.engine)
