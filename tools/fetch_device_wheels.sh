#!/usr/bin/env bash
# Download, into .whl/, the wheels tools/gpu_check.sh installs on the GPU machine (python 3.12 with
# torch, transformers, cuda-bindings, pytest-xdist, httpx, click, h11 ... but no pydantic, fastapi,
# uvicorn or xgrammar, and no network). Run here, where PyPI is reachable: the versions are the
# ones installed in this venv (what the tests here ran with). .whl/ is git-ignored and travels as a
# carried path. WITH_CUTLASS=1 adds nvidia-cutlass (~40 MB of headers): only needed if the device
# must build kernels the carried build/kernels lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PKGS=(pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types fastapi starlette
      uvicorn xgrammar apache-tvm-ffi)
[ "${WITH_CUTLASS:-0}" = 1 ] && PKGS+=(nvidia-cutlass)
rm -rf .whl && mkdir -p .whl
for pkg in "${PKGS[@]}"; do
  ver=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$pkg==$ver"
done
ls -la .whl
du -sh .whl
