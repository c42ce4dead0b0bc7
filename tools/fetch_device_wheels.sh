#!/usr/bin/env bash
# Download, into .whl/, the wheels that tools/gpu_check.sh installs on a GPU machine that has
# python 3.12 + torch but lacks these (and has no network). Run here, where PyPI is reachable;
# .whl/ is git-ignored and travels to the device as a carried path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
for pkg in pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
           typing-inspection==0.4.5 annotated-types==0.8.0 nvidia-cutlass==4.2.0.0 \
           xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$pkg"
done
ls -la .whl
