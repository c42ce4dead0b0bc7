#!/usr/bin/env bash
# kiln's one device run: the most verified information in one call of under 9 minutes.
#
#   tools/gpu_check.sh [--dry-run] [STAGE ...]      default: every stage, in this order
#
#   stage          max s  min s  what
#   env               40     5   wheels from .whl/ into /tmp/site, GPU + versions, import every
#                                engine/compiler module (fail fast: nothing else runs without it)
#   kernel-cache      40    10   the carried build/kernels: hits, build only misses, load every cubin
#   tests            200    60   in parallel: kernel tests (pytest-xdist -n 6) | graph replay vs eager,
#                                one process per backend and kernel generation | e2e cutlass vs torch | swap | fp8 KV | w4a16 GEMM
#   kernel-bench      60    30   decode/prefill kernels vs torch on a quiet GPU (kernel gens that passed)
#   latency-8b       150    90   Llama-3.1-8B shape, bf16, batch 1 and 64 (transformers' figures are
#                                known: 21.96 ms/step and 2,734 tok/s, not re-measured)
#   quant-bench      160    70   the same 8B shape quantised, against latency-8b's bf16 figures of this
#                                run: GPTQ int4 batch 1 ms/step on kiln's W4A16 GEMM and on torch's
#                                _weight_int4pack_mm (target <= 0.4x bf16), FP8 W8A8 (dynamic per-token)
#                                batch 64 tok/s; input and output 128 as there
#   w4a16-bench       30    15   kiln's W4A16 GEMM vs tinygemm and bf16 matmul, 8B projections, M 1/16/64
#   feature-tests     90    40   MoE, LoRA, spec decode, structured output with decode graphs
#   moe-bench         30    15   kiln::moe_experts grouped vs dense
#   swap-bench        30    15   KV swap GB/s
#   latency-1b        90    60   Llama-3.2-1B shape, batch 1 and 64
# Budget: DEADLINE_S (default 500) for all stages; a stage runs for min(its max, what is left) and
# is skipped when less than its min is left. The maxima up to latency-8b add up to 490 s, so the
# 8B figures are always reached; quant-bench comes next, with what the earlier stages left (their
# maxima are not shortened for it: it runs whenever they finish at least 60 s under them). Each stage writes WORK/<stage>.stage.json (status, seconds, pytest
# counts, its result JSON); after every stage the table is printed to $OUT/summary.txt, all of it
# is merged into $OUT/summary.json and packed with the logs into $OUT/gpu_check.tar.gz (3 files:
# the device tool returns at most 8). The table prints even when stages fail or are skipped.
# Kernel choice: the later stages use decode v2 / wgmma prefill (KILN_DECODE_KERNEL/KILN_PREFILL_KERNEL)
# only if all their GPU tests passed in the tests stage; no source is edited.
#
# Without CUDA every GPU stage is skipped ("no CUDA device"), so the script is testable on a CPU
# (tests/test_gpu_check.py). --dry-run / GPU_CHECK_SIMULATE_S=N replace every stage's command by
# `sleep N` (no CUDA needed) to exercise the deadline logic; GPU_CHECK_SCALE=N shrinks the limits.
#
# The device command sequence (a session with a lent H200, from the repository root of the
# checkout the device tool sends, i.e. the merged main):
#   here, once:  PYTHON=.venv/bin/python tools/fetch_device_wheels.sh   # .whl/, 11 wheels, ~7.6 MB
#                .venv/bin/python -m compiler.kernels.cli --cache-dir build/kernels --quiet
#                    # the 34 sm_90a cubins, ~5.7 MB (~2 min on 2 cores; again after any template change)
#                (.whl/ and build/ are git-ignored, so they travel only as carried paths)
#   device:      run(command="DEADLINE_S=500 tools/gpu_check.sh", carry=[".whl", "build/kernels"],
#                    timeout_s=540)   # 9 minutes: DEADLINE_S + 40 s for wheels, packing, the table
#   then:        the table is the end of output_tail; summary.json, summary.txt and gpu_check.tar.gz
#                (every stage's log, JSON and junit file) come back under files_at.
#   a rerun of some stages, while the machine is warm: run(command="tools/gpu_check.sh tests", ...)
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/kiln-gpu-out}
WORK=${GPU_CHECK_WORK:-/tmp/kiln-gpu-check}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
KCACHE=$REPO/build/kernels
export KILN_KERNEL_CACHE_DIR=$KCACHE KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
DEADLINE_S=${DEADLINE_S:-500}
SIMULATE_S=${GPU_CHECK_SIMULATE_S:-}
ALL_STAGES=(env kernel-cache tests kernel-bench latency-8b quant-bench w4a16-bench feature-tests moe-bench swap-bench latency-1b)
declare -A MAX_S=([env]=40 [kernel-cache]=40 [tests]=200 [kernel-bench]=60 [latency-8b]=150 [feature-tests]=90
                  [moe-bench]=30 [swap-bench]=30 [latency-1b]=90 [quant-bench]=160 [w4a16-bench]=30)
declare -A MIN_S=([env]=5 [kernel-cache]=10 [tests]=60 [kernel-bench]=30 [latency-8b]=90 [feature-tests]=40
                  [moe-bench]=15 [swap-bench]=15 [latency-1b]=60 [quant-bench]=70 [w4a16-bench]=15)
# GPU_CHECK_SCALE=N divides every stage's max and min (at least 1 s): the CPU test of the deadline logic.
SCALE=${GPU_CHECK_SCALE:-1}
for k in "${!MAX_S[@]}"; do
  MAX_S[$k]=$(( MAX_S[$k] / SCALE > 0 ? MAX_S[$k] / SCALE : 1 ))
  MIN_S[$k]=$(( MIN_S[$k] / SCALE > 0 ? MIN_S[$k] / SCALE : 1 ))
done
STAGES=()
for arg in "$@"; do
  case $arg in
    --dry-run) SIMULATE_S=${SIMULATE_S:-1} ;;
    *) [ -n "${MAX_S[$arg]:-}" ] || { echo "unknown stage $arg (known: ${ALL_STAGES[*]})"; exit 2; }
       STAGES+=("$arg") ;;
  esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL_STAGES[@]}")
START=$(date +%s)
NO_GPU_REASON=""   # set when the env stage finds no usable CUDA (or fails): GPU stages skip
WHEELS=${GPU_CHECK_WHEELS:-.whl}  # carried wheels; SITE: where they are installed
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONPATH=$REPO
# a rerun of some stages on a warm machine: the wheels a previous call's env stage installed
[ -f "$SITE/.kiln-gpu-check" ] && export PYTHONPATH=$REPO:$SITE

summarize() {  # the table, after every stage: a kill at the call's limit still leaves one
  $PY tools/gpu_summary.py table "$WORK" --out "$WORK" >"$OUT/summary.txt" 2>&1
  cp "$WORK/summary.json" "$OUT/summary.json" 2>/dev/null
  tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" . 2>/dev/null
}

record() {  # stage status rc seconds [gpu_summary record options...]
  local stage=$1 status=$2 rc=$3 secs=$4; shift 4
  $PY tools/gpu_summary.py record "$WORK" "$stage" "$status" "$rc" "$secs" "$@" >/dev/null
  summarize
}

# run_stage NAME CMD...: the deadline cut, the timeout, the log, the record. A command runs under
# `timeout $LIMIT`; a stage function (stage_env, stage_tests) applies $LIMIT to what it starts.
run_stage() {
  local name=$1; shift
  local now=$(date +%s)
  local left=$(( DEADLINE_S - (now - START) ))
  if [ "$left" -lt "${MIN_S[$name]}" ]; then
    echo "== $name skipped: ${left}s left of DEADLINE_S=$DEADLINE_S, needs ${MIN_S[$name]}s"
    record "$name" skipped - 0 --reason "deadline: ${left}s left, needs ${MIN_S[$name]}s"; return
  fi
  if [ "$name" != env ] && [ -n "$NO_GPU_REASON" ]; then
    echo "== $name skipped: $NO_GPU_REASON"
    record "$name" skipped - 0 --reason "$NO_GPU_REASON"; return
  fi
  LIMIT=${MAX_S[$name]}
  [ "$LIMIT" -gt "$left" ] && LIMIT=$left
  echo "== $name (limit ${LIMIT}s, ${left}s left)"
  local t0=$(date +%s) rc
  if [ -n "$SIMULATE_S" ]; then
    timeout "$LIMIT" sleep "$SIMULATE_S" >"$WORK/$name.log" 2>&1; rc=$?
  elif declare -F "$1" >/dev/null; then
    "$@" >"$WORK/$name.log" 2>&1; rc=$?
  else
    timeout "$LIMIT" "$@" >"$WORK/$name.log" 2>&1; rc=$?
  fi
  local secs=$(( $(date +%s) - t0 )) status=ok
  [ "$rc" -ne 0 ] && status=failed
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && status=timeout
  local extra=()
  [ -f "$WORK/$name.json" ] && extra+=(--result "$WORK/$name.json")
  local junits=("$WORK/$name"*.xml)
  [ -e "${junits[0]}" ] && extra+=(--junit "${junits[@]}")
  [ "$status" = timeout ] && extra+=(--reason "cut at ${LIMIT}s")
  record "$name" "$status" "$rc" "$secs" "${extra[@]}"
  echo "== $name $status rc=$rc (${secs}s)"; tail -n 15 "$WORK/$name.log"
  LAST_STATUS=$status
}

# ---- the stages ---------------------------------------------------------------------------------
stage_env() {
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || { echo "wheel install failed"; return 1; }
    touch "$SITE/.kiln-gpu-check"
    export PYTHONPATH=$REPO:$SITE
  fi
  nvidia-smi -L 2>&1 | head -4
  timeout "$LIMIT" $PY - "$WORK/env.json" <<'EOF'
import importlib, json, pkgutil, sys
import torch, transformers
info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available()}
if info["cuda"]:
    info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                sms=torch.cuda.get_device_properties(0).multi_processor_count)
failed = {}
for pkg in ("engine", "compiler"):
    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        try:
            importlib.import_module(m.name)
        except Exception as e:  # noqa: BLE001 - reported: the stage fails
            failed[m.name] = f"{type(e).__name__}: {e}"[:300]
info["import_failures"] = failed
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
sys.exit(1 if failed else 0)
EOF
}

stage_tests() {
  # Six processes under one limit: the kernel tests across 6 xdist workers (an illegal access
  # poisons only its own CUDA context), and the engine-level GPU tests split so that each cold
  # compile-and-capture cycle (graph replay vs eager, per backend and kernel generation) has a
  # process of its own.
  local pids=() names=(kernels graph-cutlass graph-cutlass-v2 graph-torch e2e swap fp8kv w4a16) rc=0 r i
  local args=(
    "-n 6 --timeout 120 tests/test_kernels_gpu.py"
    "-m gpu --timeout 180 tests/test_cuda_graph.py -k cutlass_v1"
    "-m gpu --timeout 180 tests/test_cuda_graph.py -k cutlass_v2"
    "-m gpu --timeout 180 tests/test_cuda_graph.py -k torch"
    "-m gpu --timeout 150 tests/test_e2e_gpu.py"
    "-m gpu --timeout 150 tests/test_swap.py"
    "-m gpu --timeout 150 tests/test_fp8_kv_gpu.py"
    "-m gpu --timeout 150 tests/test_w4a16_gpu.py")
  for i in "${!names[@]}"; do
    # shellcheck disable=SC2086  # the argument strings split on purpose
    timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider ${args[$i]} --junitxml="$WORK/tests-${names[$i]}.xml" \
      >"$WORK/tests-${names[$i]}.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; r=$?
    echo "tests-${names[$i]}: rc=$r  $(tail -n 1 "$WORK/tests-${names[$i]}.log")"
    [ $r -eq 124 ] && rc=124
    [ $r -ne 0 ] && [ $rc -eq 0 ] && rc=$r
  done
  return $rc
}

stage_quant_bench() {
  # Three engines of the 8B shape: int4 on kiln's W4A16 GEMM (2/5 of the limit), int4 on torch's
  # tinygemm (3/10), fp8 under what is then left (less 5 s for the comparison); bf16 from this
  # run's latency-8b. quant-bench.json: kiln's int4 figures, plus tinygemm's (tinygemm_*).
  local t0=$(date +%s) common=(--preset llama-3.1-8b --input-len 128 --output-len 128 --warmup-steps 4)
  KILN_INT4_KERNEL=kiln timeout $(( LIMIT * 2 / 5 )) $PY -m engine.bench.latency "${common[@]}" \
    --quantization gptq --batch-size 1 --json "$WORK/quant-int4.json"; local r1=$?
  KILN_INT4_KERNEL=tinygemm timeout $(( LIMIT * 3 / 10 )) $PY -m engine.bench.latency "${common[@]}" \
    --quantization gptq --batch-size 1 --json "$WORK/quant-int4-tinygemm.json"; local r3=$?
  local left=$(( LIMIT - ($(date +%s) - t0) - 5 )); [ "$left" -lt 1 ] && left=1
  timeout "$left" $PY -m engine.bench.latency "${common[@]}" --quantization fp8 --batch-size 64 \
    --json "$WORK/quant-fp8.json"; local r2=$?
  $PY -m engine.bench.quant_compare --bf16 "$WORK/latency-8b.json" --int4 "$WORK/quant-int4.json" \
    --fp8 "$WORK/quant-fp8.json" --json "$WORK/quant-bench.json"
  $PY -m engine.bench.quant_compare --bf16 "$WORK/latency-8b.json" --int4 "$WORK/quant-int4-tinygemm.json" \
    --json "$WORK/quant-bench-tinygemm.json" | sed 's/^int4/int4 tinygemm/'
  $PY - "$WORK/quant-bench.json" "$WORK/quant-bench-tinygemm.json" <<'EOF'
import json, sys
main, tiny = (json.load(open(p)) for p in sys.argv[1:3])
for k in ("int4_b1_ms", "int4_over_bf16_ms", "int4_verdict"):
    if k in tiny:
        main["tinygemm_" + k.removeprefix("int4_")] = tiny[k]
if "int4_b1_ms" in main and "int4_b1_ms" in tiny:
    main["kiln_over_tinygemm_ms"] = main["int4_b1_ms"] / tiny["int4_b1_ms"]
    print(f"int4 batch 1: kiln {main['int4_b1_ms']:.3f} ms/step vs tinygemm {tiny['int4_b1_ms']:.3f} -> "
          f"{main['kiln_over_tinygemm_ms']:.3f}x")
json.dump(main, open(sys.argv[1], "w"), indent=1)
EOF
  [ "$r1" -ne 0 ] && return "$r1"
  [ "$r3" -ne 0 ] && return "$r3"
  return "$r2"
}

for stage in "${STAGES[@]}"; do
  LAST_STATUS=""
  case $stage in
    env)
      run_stage env stage_env
      if [ -n "$SIMULATE_S" ]; then :
      elif [ "$LAST_STATUS" != ok ]; then NO_GPU_REASON="env stage failed: engine imports or wheels (see env.log)"
      elif ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        NO_GPU_REASON="no CUDA device"
      fi ;;
    kernel-cache)
      run_stage kernel-cache $PY -m compiler.kernels.cli --check \
        --cache-dir "$KCACHE" --json "$WORK/kernel-cache.json" ;;
    tests)
      run_stage tests stage_tests
      # the newest kernel generations serve the later stages only where all their tests passed
      for kv in $($PY tools/gpu_summary.py kernel-env "$WORK/tests-kernels.xml" 2>/dev/null); do
        echo "kernel generation verified: $kv"; export "${kv?}"
      done ;;
    kernel-bench)
      run_stage kernel-bench $PY -m compiler.kernels.bench --quick \
        --cache-dir "$KCACHE" --decode-kernel "${KILN_DECODE_KERNEL:-v1}" \
        --prefill-kernel "${KILN_PREFILL_KERNEL:-mma}" --json "$WORK/kernel-bench.json" ;;
    latency-8b)
      run_stage latency-8b $PY -m engine.bench.latency --preset llama-3.1-8b \
        --batch-size 1,64 --input-len 128 --output-len 128 --json "$WORK/latency-8b.json" ;;
    quant-bench)
      run_stage quant-bench stage_quant_bench ;;
    w4a16-bench)
      run_stage w4a16-bench $PY -m compiler.kernels.w4a16_bench --cache-dir "$KCACHE" \
        --json "$WORK/w4a16-bench.json" ;;
    feature-tests)
      run_stage feature-tests $PY -m pytest -q -p no:cacheprovider -m gpu \
        --timeout 80 tests/test_features_gpu.py --junitxml="$WORK/feature-tests.xml" ;;
    moe-bench)
      run_stage moe-bench $PY -m compiler.moe_bench --json "$WORK/moe-bench.json" ;;
    swap-bench)
      run_stage swap-bench $PY -m engine.bench.swap --json "$WORK/swap-bench.json" ;;
    latency-1b)
      run_stage latency-1b $PY -m engine.bench.latency --preset llama-3.2-1b \
        --batch-size 1,64 --input-len 128 --output-len 128 --json "$WORK/latency-1b.json" ;;
  esac
done

summarize
echo
cat "$OUT/summary.txt"
echo "(total $(( $(date +%s) - START ))s of DEADLINE_S=$DEADLINE_S; logs and JSON: $OUT/gpu_check.tar.gz)"
