# kiln's commands. `make serve` and `make test` set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
# CPU build of torch from local disk (an unpinned torch would pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv serve test test-fast bench kernels gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" -e '.[test,cuda]'
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(KILN) serve

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: venv
	$(KILN) bench throughput

kernels: venv
	$(KILN) build-kernels

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
