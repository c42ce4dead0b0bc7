#!/usr/bin/env bash
# The one command a session with a lent H200 runs (see README "GPU check").
#   tools/gpu_check.sh [STAGE ...]     default: all stages, in this order:
#     env kernels new-kernels gpu-tests kernel-bench latency swap moe feature-tests warm-start throughput
# Installs what the device lacks from carried wheels (.whl/), builds the kernels into
# build/kernels (a cache hit when the carried cubins match), runs the `gpu`-marked tests
# and the GPU benchmarks, writes full logs and JSON under $OUT, and prints a short table last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
KCACHE=$PWD/build/kernels
export KILN_KERNEL_CACHE_DIR=$KCACHE KILN_CACHE_DIR=/tmp/kiln-cache
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env kernels new-kernels gpu-tests kernel-bench latency swap moe feature-tests warm-start throughput)

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi

# The whole check keeps within DEADLINE_S (default 500 s): each stage's timeout is cut to what
# is left, and stages that would start with under 20 s left are skipped (listed as such).
DEADLINE_S=${DEADLINE_S:-500}
START=$(date +%s)
SUMMARY=()
LAST_RC=0
run_stage() {  # name timeout_s command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  local left=$(( DEADLINE_S - (t0 - START) ))
  if [ "$left" -lt 20 ]; then
    SUMMARY+=("$(printf '%-14s skipped (deadline)' "$name")"); LAST_RC=skipped; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  LAST_RC=$rc
  local dt=$(( $(date +%s) - t0 ))
  SUMMARY+=("$(printf '%-14s rc=%-4s %4ss  %s' "$name" "$rc" "$dt" "$(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1 | cut -c1-90)")")
  echo "== $name rc=$rc (${dt}s)"; tail -n 25 "$OUT/$name.log"
}

for stage in "${STAGES[@]}"; do
  case $stage in
    env) run_stage env 60 bash -c "nvidia-smi; nvcc --version; $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'" ;;
    kernels) run_stage kernels 240 $PY -m compiler.kernels.cli --cache-dir "$KCACHE" --quiet ;;
    new-kernels)
      # Switching kernels on edits compiler/cutlass_ops.py in this checkout: only where the tests
      # really ran (a machine without CUDA skips them, which would look like a pass).
      if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "new-kernels: no CUDA device here, skipped"; continue
      fi
      # The newest kernels run first, each in its own process (an illegal access poisons the
      # CUDA context).
      # A kernel that passes is switched on in this checkout for the later stages (benchmarks);
      # make the same one-line change in the repository once the run's numbers are recorded.
      run_stage wgmma-tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py -k wgmma
      [ "$LAST_RC" = 0 ] && { echo "wgmma prefill passed: USE_WGMMA_PREFILL=True for this run";
        sed -i 's/^USE_WGMMA_PREFILL = False/USE_WGMMA_PREFILL = True/' compiler/cutlass_ops.py; }
      run_stage decode-v2-tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py -k "v2 and not wgmma"
      [ "$LAST_RC" = 0 ] && { echo "decode v2 passed: USE_DECODE_V2=True for this run";
        sed -i 's/^USE_DECODE_V2 = False/USE_DECODE_V2 = True/' compiler/cutlass_ops.py; } ;;
    gpu-tests)
      # Only the modules that hold gpu-marked tests (the server's need packages the device lacks).
      run_stage gpu-tests 200 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -k "not wgmma" \
        $(grep -l "mark.gpu" tests/test_*.py | grep -v test_features_gpu) ;;
    feature-tests)
      # MoE, LoRA, speculative decoding and structured outputs with decode graphs (built on a CPU).
      run_stage feature-tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 140 tests/test_features_gpu.py ;;
    kernel-tests) run_stage kernel-tests 200 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py ;;
    kernel-bench) run_stage kernel-bench 70 $PY -m compiler.kernels.bench --cache-dir "$KCACHE" --json "$OUT/kernel_bench.json" ${KERNEL_BENCH_ARGS:-} ;;
    latency)
      # 8B first (the headline targets), then 1B, then the 8B again on a warm compile cache
      # (identical command, so the Inductor cache hits) for the start-up figure.
      for preset in llama-3.1-8b llama-3.2-1b; do
        run_stage "latency-$preset" 200 $PY -m engine.bench.latency --preset "$preset" --batch-size 1,64 \
          --input-len 128 --output-len 128 --baseline --json "$OUT/latency-$preset.json"
      done ;;
    warm-start)
      run_stage warm-start-8b 120 $PY -m engine.bench.latency --preset llama-3.1-8b --batch-size 1,64 \
        --input-len 128 --output-len 128 --json "$OUT/warm-start-8b.json" ;;
    swap) run_stage swap 60 $PY -m engine.bench.swap --json "$OUT/swap.json" ;;
    moe) run_stage moe 60 $PY -m compiler.moe_bench --json "$OUT/moe.json" ;;
    throughput) run_stage throughput 120 $PY -c "import sys; from engine.bench.throughput import main; sys.exit(main(['--device','cuda','--dtype','bfloat16','--num-requests','256','--json','$OUT/throughput.json']))" ;;
    *) echo "unknown stage $stage" ;;
  esac
done

echo
echo "================ kiln GPU check summary ================"
printf '%s\n' "${SUMMARY[@]}"
$PY tools/gpu_summary.py "$OUT" 2>/dev/null || true
