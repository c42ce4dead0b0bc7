# kiln's commands. `make serve` and `make test` set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
# CPU build of torch from local disk (an unpinned torch would pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# The CUDA extras (cuda-python, CUTLASS) only where there is a GPU to use them.
CUDA_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo ",cuda")
# Arguments for `make serve`, e.g. make serve SERVE_ARGS="/models/llama --max-model-len 8k".
SERVE_ARGS ?=

.PHONY: venv venv-test test-services serve test lint format typecheck bench kernels wheel settings-table clean

# (Python 3.11's own pip does all kiln needs, editable installs included: upgrading it cost 18 s of a
# fresh `make serve`, mostly the index's round trips, for nothing the install uses.)
$(VENV)/.python:
	test -x $(PY) || python3 -m venv $(VENV)
	touch $@

# The runtime only: what `kiln serve` needs. torch (and numpy, which it warns without) first: the
# C++ CPU kernels need nothing else, so they build (a visible step, one line per library) while pip
# installs the rest, into compiler/kernels/prebuilt/, where the loaders look first (for an editable
# install, the package's own folder, as a wheel ships them); a failed build is not fatal (a start
# compiles it, or runs the torch paths).
CPU_KERNELS := compiler/kernels/prebuilt
$(VENV)/.runtime: pyproject.toml $(VENV)/.python
	$(PY) -m pip install -q "$(TORCH_PIN)" numpy
	$(PY) -m compiler.kernels.cpu_prebuild --into $(CPU_KERNELS) & kernels=$$!; \
	$(PY) -m pip install -q "$(TORCH_PIN)" -e '.$(if $(CUDA_EXTRA),[cuda],)' || { kill $$kernels; exit 1; }; \
	wait $$kernels || echo "kiln: some CPU kernels were not built; the first start compiles them"
	touch $@

# The runtime plus the test tools, and the CUDA extras always: the CUTLASS headers let the
# suite compile every kernel for sm_90a with nvcc even on a machine without a GPU (CI).
$(VENV)/.installed: pyproject.toml $(VENV)/.runtime
	$(PY) -m pip install -q "$(TORCH_PIN)" -e '.[test,cuda,lint]'
	touch $@

venv: $(VENV)/.runtime

venv-test: $(VENV)/.installed

serve: $(VENV)/.runtime
	$(KILN) serve $(SERVE_ARGS)

# The remote KV tier's test starts a real redis-server, the chat page's test a headless chromium (Debian's
# packages): installed when missing and we are root with apt-get; otherwise the tests say what to
# install (and fail under CI).
test-services:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is not installed: apt-get install redis-server (the remote KV tier's test needs it)"; fi; }
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is not installed: apt-get install chromium (the chat page's browser test needs it)"; fi; }

# --durations=25: the slowest tests' times in every log (CI's suite must stay under 20 minutes).
test: $(VENV)/.installed test-services
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

bench: $(VENV)/.runtime
	$(KILN) bench throughput

kernels: $(VENV)/.runtime
	$(KILN) build-kernels

# A wheel that ships the C++ CPU libraries of every ISA level kiln dispatches to (DEFAULT, AVX2,
# AVX512; built against this venv's torch, whose version is in their key): setup.py's build hook
# builds them (compiler/kernels/wheel_build.py) where torch is importable, so no build isolation.
wheel: $(VENV)/.runtime
	$(PY) -m pip install -q "setuptools>=70.1"
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

# Regenerate the docs' settings, flags and metrics tables from the code.
settings-table: $(VENV)/.runtime
	$(PY) tools/settings_table.py --write docs/*.md

# Type-check the checked packages (settings in pyproject.toml's [tool.mypy]; mypy from the `lint` extra).
TYPECHECK_PATHS ?= engine/core engine/config engine/runtime engine/spec_decode
typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy $(TYPECHECK_PATHS)

# Lint and format check (rules and versions pinned in pyproject.toml; `make format` applies them).
LINT_PATHS := engine compiler templates tests tools
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix --select I $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache
