#!/usr/bin/env bash
# Run the CPU test suite under the GPU machine's torch and transformers (torch 2.11, transformers
# 5.17: /work/.library/device/KINDS.md), before spending device time. Not part of `make test`: it
# downloads a CUDA build of torch (~3.5 GB; it runs on the CPU). It caught a bug that only
# torch 2.11 shows (compiler/kernels/ops.py: the ops take the whole KV cache and a layer index).
#   tools/test_device_versions.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICE_VENV:-/tmp/kiln-device-venv}
TORCH=${DEVICE_TORCH:-torch==2.11.0}
TRANSFORMERS=${DEVICE_TRANSFORMERS:-transformers==5.17.*}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH" "$TRANSFORMERS"
fi
# Every run: kiln's own dependencies may have grown since the venv was made (torch and
# transformers stay pinned to the device's).
"$VENV/bin/pip" install -q -e '.[test,cuda]' "$TORCH" "$TRANSFORMERS"
"$VENV/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
