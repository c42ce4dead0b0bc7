#!/usr/bin/env bash
# kiln's one device run: the most verified information in one call of under 10 minutes.
#
#   tools/gpu_check.sh [--dry-run | --plan] [STAGE ...]   default: every stage, in this order
#   (--plan: print the stages' budget against DEADLINE_S and stop; every run prints it first)
#
#   stage            max s  min s  what
#   env                 40     5   wheels from .whl/ into /tmp/site, GPU + versions, import every
#                                  engine/compiler module (fail fast: nothing else runs without it)
#   kernel-cache        20     5   the carried build/kernels: hits, build only misses, load every cubin
#   tests              220    60   GPU tests in parallel processes, one per kernel generation and
#                                  engine target (see TEST_GROUPS; speculative decoding under graphs:
#                                  spec-torch, spec-cutlass); meanwhile the 8B engines of
#                                  latency-8b and quant-bench are built in the background
#   kernel-bench        45    20   decode/prefill kernels (v1 / mma, verified) vs torch, quiet GPU
#   kernel-bench-v2     35    15   the same for decode v2 / wgmma prefill, in a process of its own,
#                                  only for the generations whose GPU tests all passed
#   latency-8b         120    30   Llama-3.1-8B shape, bf16, cutlass, CUDA graphs, overlap on: batch
#                                  1 and 64 (transformers' figures are known: 21.96 ms/step and
#                                  2,734 tok/s, not re-measured)
#   quant-bench         90    30   the same shape, GPTQ int4 on kiln's W4A16 GEMM, batch 1, against
#                                  latency-8b's bf16 batch 1 (target <= 0.4x)
#   w4a16-bench         25    10   kiln's W4A16 GEMM vs tinygemm and bf16 matmul, 8B projections
#   moe-bench           25    10   kiln::moe_experts grouped vs dense
#   swap-bench          20    10   KV swap GB/s
#   latency-1b          90    60   Llama-3.2-1B shape, batch 1 and 64 (built and compiled here)
#
# Each test group's engine builds (GROUP_BUILDS) and their estimated seconds print beside the tests
# stage's limit in the plan. Budget: DEADLINE_S (default 500) for all stages; a stage runs for min(its max, what is left) and
# is skipped when less than its min is left. The maxima up to latency-8b add up to 480 s, so the
# 8B figures are always reached. What the budget rests on (no cold compile has been timed on the
# H200 yet; every engine stage now records its start-up, compile and capture seconds, so the next
# run measures them):
#   - kernel tests, 2026-11-29 on the H200: 78 passed in 27.6 s; kernel bench --quick: 13.4 s;
#   - Inductor cold compiles on this project's 2-core CPU machine: the 2-layer graph-test model 83 s
#     (load 7), a 32-layer 8B-layout model 71 s (benchmarks/); Dynamo traces ~10 s of that. The
#     device host has 16 cores for Triton's compile workers.
# So the two 8B engines compile during the tests stage (their compile is the long part; each
# waits for a go file before it measures anything, on a quiet GPU), the latency stages then only
# time; the quant bench measures one engine (int4 on kiln's kernel), not three: torch's tinygemm
# (w4a16-bench compares the GEMMs) and FP8 W8A8 batch 64 are optional stages (quant-tinygemm,
# quant-fp8: each one more cold 8B compile, 120/60 s), run by name only. Test processes compile
# with TORCHINDUCTOR_COMPILE_THREADS=2, the background engines with 4 (16 cores shared).
#
# Each stage writes WORK/<stage>.stage.json (status, seconds, pytest counts, the crash if any, its
# result JSON); after every stage the table is printed to $OUT/summary.txt, all of it is merged
# into $OUT/summary.json and packed with the logs into $OUT/gpu_check.tar.gz (3 files: the device
# tool returns at most 8). The table prints even when stages fail, crash or are skipped. Under
# gpu_check a skipped GPU test is a failure (KILN_GPU_CHECK_STRICT=1, tests/conftest.py).
#
# Without CUDA every GPU stage is skipped ("no CUDA device"), so the script is testable on a CPU
# (tests/house/test_gpu_check.py). --dry-run / GPU_CHECK_SIMULATE_S=N replace every stage's command by
# `sleep N` to exercise the deadline logic; GPU_CHECK_SCALE=N shrinks the limits, GPU_CHECK_MAX_S=STAGE=N,...
# sets some.
# GPU_CHECK_FAKE=1: a fake device. Every stage's command is its CPU equivalent or a stub
# (tools/gpu_check_fake.py): the latency stages run the real `kiln bench latency` driver on a tiny
# model on the CPU (a GPU's defaults: overlap on, chunked prefill), swap-bench the real swap bench,
# each test group's real pytest arguments are collected (`pytest --collect-only`, as on an sm_90 GPU;
# every group's in one process first, one torch import and not twelve; a missing path or no test
# collected fails the group) and the group runs one stand-in test per test collected, under the same
# timeout and junit file; the rest stubs that write their stage's JSON
# as the real command does. GPU_CHECK_CRASH=a,b,... makes those stages, test groups
# (tests:kernels-v2) or engines (quant-int4) crash midway (SIGSEGV after their first result), as a
# sticky CUDA fault would; GPU_CHECK_HANG=tests:NAME,... makes those groups hang after two tests
# (their limit cuts them). GPU_CHECK_GROUPS=NAME,...: only those test groups run.
#
# The device command sequence (a session with a lent H200, from the repository root of the
# checkout the device tool sends, i.e. the merged main):
#   here, once:  PYTHON=.venv/bin/python tools/fetch_device_wheels.sh   # .whl/, 11 wheels, ~7.6 MB
#                .venv/bin/python -m compiler.kernels.cli --cache-dir build/kernels --quiet --prune
#                    # the 69 sm_90a variants: 9.1 MiB of cubins, 10.4 MiB with --prune (3.5 min
#                    # of CPU on 2 cores, 14 min wall on the loaded machine; again after a template change)
#                .venv/bin/python -m compiler.kernels.cli --check --no-build --cache-dir build/kernels
#                    # must say 69/69 hits: the carried cache matches the templates
#                (.whl/ and build/ are git-ignored, so they travel only as carried paths)
#   device:      run(command="DEADLINE_S=500 tools/gpu_check.sh", kind="nvidia-h200",
#                    carry=[".whl", "build/kernels"], timeout_s=560)   # DEADLINE_S + 60 s for wheels, packing,
#                    # the table; kind: the floors are the H200's (on an H100 the summary scales each bound
#                    # by the memory bandwidths and names the card: tools/gpu_summary.py card_bound)
#   then:        the table is the end of output_tail; summary.json, summary.txt and gpu_check.tar.gz
#                (every stage's log, JSON and junit file) come back under files_at.
#   a rerun of some stages, while the machine is warm: run(command="tools/gpu_check.sh tests", ...)
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/kiln-gpu-out}
WORK=${GPU_CHECK_WORK:-/tmp/kiln-gpu-check}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
KCACHE=$REPO/build/kernels
export KILN_KERNEL_CACHE_DIR=$KCACHE KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
export KILN_GPU_CHECK_STRICT=1  # tests/conftest.py: a skipped GPU test fails
DEADLINE_S=${DEADLINE_S:-500}
SIMULATE_S=${GPU_CHECK_SIMULATE_S:-}
FAKE=${GPU_CHECK_FAKE:-}
CRASH=",${GPU_CHECK_CRASH:-},"
HANG=",${GPU_CHECK_HANG:-},"
GROUPS_WANTED=${GPU_CHECK_GROUPS:-}
ALL_STAGES=(env kernel-cache tests kernel-bench kernel-bench-v2 latency-8b quant-bench w4a16-bench moe-bench
            swap-bench latency-1b)
OPTIONAL_STAGES=(quant-tinygemm quant-fp8)  # run only when named
declare -A MAX_S=([env]=40 [kernel-cache]=20 [tests]=220 [kernel-bench]=45 [kernel-bench-v2]=35 [latency-8b]=120
                  [quant-bench]=90 [w4a16-bench]=25 [moe-bench]=25 [swap-bench]=20 [latency-1b]=90
                  [quant-tinygemm]=120 [quant-fp8]=120)
declare -A MIN_S=([env]=5 [kernel-cache]=5 [tests]=60 [kernel-bench]=20 [kernel-bench-v2]=15 [latency-8b]=30
                  [quant-bench]=30 [w4a16-bench]=10 [moe-bench]=10 [swap-bench]=10 [latency-1b]=60
                  [quant-tinygemm]=60 [quant-fp8]=60)
# GPU_CHECK_SCALE=N divides every stage's max and min (at least 1 s): the CPU test of the deadline logic.
SCALE=${GPU_CHECK_SCALE:-1}
for k in "${!MAX_S[@]}"; do
  MAX_S[$k]=$(( MAX_S[$k] / SCALE > 0 ? MAX_S[$k] / SCALE : 1 ))
  MIN_S[$k]=$(( MIN_S[$k] / SCALE > 0 ? MIN_S[$k] / SCALE : 1 ))
done
# GPU_CHECK_MAX_S=STAGE=N,...: those stages' maxima in seconds, after the scale (a min above its max comes
# down to it), so a CPU test waits out a limit of seconds, or gives a stage it does not test room under load.
IFS=, read -ra LIMIT_OVERRIDES <<<"${GPU_CHECK_MAX_S:-}"
for kv in "${LIMIT_OVERRIDES[@]}"; do
  k=${kv%%=*} v=${kv#*=}
  { [ -n "${MAX_S[$k]:-}" ] && [[ $v =~ ^[0-9]+$ ]] && [ "$v" -gt 0 ]; } || {
    echo "GPU_CHECK_MAX_S: '$kv' is not STAGE=SECONDS (stages: ${!MAX_S[*]})"; exit 2; }
  MAX_S[$k]=$v
  [ "${MIN_S[$k]}" -gt "$v" ] && MIN_S[$k]=$v
done
STAGES=()
PLAN_ONLY=""
for arg in "$@"; do
  case $arg in
    --dry-run) SIMULATE_S=${SIMULATE_S:-1} ;;
    --plan) PLAN_ONLY=1 ;;
    *) [ -n "${MAX_S[$arg]:-}" ] || { echo "unknown stage $arg (known: ${ALL_STAGES[*]} ${OPTIONAL_STAGES[*]})"; exit 2; }
       STAGES+=("$arg") ;;
  esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL_STAGES[@]}")

# The tests stage's processes: NAME|pytest arguments. Kernel tests are split by generation so a
# fault in a newer one (sticky: it ends the CUDA context, and every later test of that process
# errors) cannot spoil the older generation's verdicts; engine-level tests run one process per
# backend and kernel generation (each a cold compile-and-capture cycle).
TEST_GROUPS=(
  "kernels-v1|-n 3 --timeout 120 -k 'not v2 and not wgmma' tests/compiler/test_kernels_gpu.py tests/layers/test_fp8_kv_gpu.py"
  "kernels-v2|-n 3 --timeout 120 -k 'v2 or wgmma' tests/compiler/test_kernels_gpu.py tests/layers/test_fp8_kv_gpu.py"
  "int4|-m gpu --timeout 120 tests/layers/test_w4a16_gpu.py tests/layers/test_quant_int4.py"
  "graph-torch|-m gpu --timeout 200 -k torch tests/worker/test_cuda_graph.py"
  "graph-cutlass-v1|-m gpu --timeout 200 -k cutlass_v1 tests/worker/test_cuda_graph.py"
  "graph-cutlass-v2|-m gpu --timeout 200 -k cutlass_v2 tests/worker/test_cuda_graph.py"
  "e2e-v1|-m gpu --timeout 150 -k cutlass_v1 tests/runtime/test_e2e_gpu.py"
  "e2e-v2|-m gpu --timeout 150 -k cutlass_v2 tests/runtime/test_e2e_gpu.py"
  "swap|-m gpu --timeout 150 tests/worker/test_swap.py tests/runtime/test_kv_tiers_gpu.py"
  "features|-m gpu --timeout 200 tests/runtime/test_features_gpu.py"
  "spec-torch|-m gpu --timeout 200 -k torch tests/spec_decode/test_spec_gpu.py"
  "spec-cutlass|-m gpu --timeout 200 -k cutlass tests/spec_decode/test_spec_gpu.py"
)
# What each group builds, ENGINES:COLD, counted from its test files: engines made, and of their
# compiled models those that miss the group's Inductor cache (a model the group compiled already, or
# a draft model of the target's shapes, only traces again; an eager engine compiles nothing). A
# speculative engine compiles two models (target and draft). The plan prints each group's builds
# and the estimate COLD_COMPILE_S * cold + WARM_BUILD_S * (engines - cold) beside the stage's limit
# (the groups run side by side, each within the tests stage's limit).
declare -A GROUP_BUILDS=([kernels-v1]=0:0 [kernels-v2]=0:0 [int4]=3:2 [graph-torch]=3:1 [graph-cutlass-v1]=3:1
                         [graph-cutlass-v2]=3:1 [e2e-v1]=2:0 [e2e-v2]=2:0 [swap]=1:0 [features]=6:2
                         [spec-torch]=4:3 [spec-cutlass]=3:2)
COLD_COMPILE_S=45  # a 2-layer model's cold compile and capture with 2 compile threads (estimate: not timed yet)
WARM_BUILD_S=10    # an engine whose graphs hit the cache (Dynamo traces again), or an eager one

plan() {  # each stage's max/min s, their sum against the deadline (the 8B figures must fit in it)
  local s total=0 to8b="" entry name engines cold est
  for s in "${STAGES[@]}"; do
    echo "plan: $s max ${MAX_S[$s]}s min ${MIN_S[$s]}s"
    total=$(( total + MAX_S[$s] ))
    [ "$s" = latency-8b ] && to8b=$total
    [ "$s" = tests ] || continue
    for entry in "${TEST_GROUPS[@]}"; do  # each test group's engine builds beside the stage's limit
      name=${entry%%|*} engines=${GROUP_BUILDS[${entry%%|*}]%%:*} cold=${GROUP_BUILDS[${entry%%|*}]##*:}
      est=$(( cold * COLD_COMPILE_S + (engines - cold) * WARM_BUILD_S ))
      echo "plan:   group $name: $engines engine builds ($cold cold compiles), ~${est}s of builds," \
           "limit ${MAX_S[tests]}s$([ "$est" -gt "${MAX_S[tests]}" ] && echo " OVER")"
    done
  done
  echo "plan: stage maxima ${total}s in all${to8b:+, ${to8b}s up to latency-8b}, DEADLINE_S=$DEADLINE_S" \
       "(the deadline cuts the rest); device call timeout_s=$(( DEADLINE_S + 60 )) of at most 600"
}
plan
[ -n "$PLAN_ONLY" ] && exit 0
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
START=$(date +%s)
QUIET_WAIT_S=${GPU_CHECK_QUIET_WAIT_S:-30}  # the most a timed stage waits for background engines to build
NO_GPU_REASON=""   # set when the env stage finds no usable CUDA (or fails): GPU stages skip
WHEELS=${GPU_CHECK_WHEELS:-.whl}  # carried wheels; SITE: where they are installed
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONPATH=$REPO
# a rerun of some stages on a warm machine: the wheels a previous call's env stage installed
[ -f "$SITE/.kiln-gpu-check" ] && export PYTHONPATH=$REPO:$SITE

crashes() { [[ $CRASH == *",$1,"* ]]; }  # GPU_CHECK_CRASH names this stage (or tests:<group>)
hangs() { [[ $HANG == *",$1,"* ]]; }  # GPU_CHECK_HANG names this test group (tests:<group>)
wanted() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

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
# `timeout $LIMIT`; a stage function (stage_*) applies $LIMIT to what it starts.
run_stage() {
  local name=$1; shift
  local now=$(date +%s)
  local left=$(( DEADLINE_S - (now - START) ))
  local result=()
  [ -f "$WORK/$name.json" ] && result=(--result "$WORK/$name.json")  # (an engine built ahead: its start-up)
  if [ "$left" -lt "${MIN_S[$name]}" ]; then
    echo "== $name skipped: ${left}s left of DEADLINE_S=$DEADLINE_S, needs ${MIN_S[$name]}s"
    record "$name" skipped - 0 --reason "deadline: ${left}s left, needs ${MIN_S[$name]}s" "${result[@]}"; return
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
  local extra=(--log "$WORK/$name.log")
  [ -f "$WORK/$name.json" ] && extra+=(--result "$WORK/$name.json")
  local junits=("$WORK/$name"*.xml)
  [ -e "${junits[0]}" ] && extra+=(--junit "${junits[@]}")
  [ "$status" = timeout ] && extra+=(--reason "cut at ${LIMIT}s")
  [ -f "$WORK/$name.engines" ] && extra+=(--engines "$(cat "$WORK/$name.engines")")
  record "$name" "$status" "$rc" "$secs" "${extra[@]}"
  echo "== $name $status rc=$rc (${secs}s)"; tail -n 15 "$WORK/$name.log"
  LAST_STATUS=$status
}

# wait_pid PID LIMIT: its exit status, or 124 after LIMIT s (then TERM, and KILL 3 s later)
wait_pid() {
  local pid=$1 limit=$2 t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
      kill -TERM "$pid" 2>/dev/null; sleep 3; kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 0.5
  done
  wait "$pid"
}

# ---- engines: `kiln bench latency` processes, built ahead (in the background) and timed later ----
declare -A ENGINE_PID=()
engine_args() {  # NAME -> ENGINE_ARGS
  case $1 in
    latency-8b) ENGINE_ARGS=(--preset llama-3.1-8b --batch-size 1,64) ;;
    latency-1b) ENGINE_ARGS=(--preset llama-3.2-1b --batch-size 1,64) ;;
    quant-int4) ENGINE_ARGS=(--preset llama-3.1-8b --quantization gptq --int4-kernel kiln --batch-size 1 --warmup-steps 4) ;;
    quant-int4-tinygemm) ENGINE_ARGS=(--preset llama-3.1-8b --quantization gptq --int4-kernel tinygemm --batch-size 1
                                      --warmup-steps 4) ;;
    quant-fp8-w8a8) ENGINE_ARGS=(--preset llama-3.1-8b --quantization fp8 --batch-size 64 --warmup-steps 4) ;;
  esac
  # the serving defaults on a GPU, named: the CUTLASS kernels (a missing kernel fails the stage,
  # never falls back to the torch backend), CUDA graphs (not --enforce-eager), overlap scheduling
  ENGINE_ARGS+=(--input-len 128 --output-len 128 --attention-backend cutlass --async-scheduling true)
  if [ -n "$FAKE" ]; then  # the same driver on a tiny model on the CPU: overlap on, chunked prefill (eager:
    # no C++ CPU kernel to build first, tests/house/test_gpu_check.py keeps the dry run short)
    ENGINE_ARGS=(--model "$WORK/fake-model" --device cpu --batch-size "$([[ $1 == latency-* ]] && echo 1,3 || echo 1)"
                 --input-len 8 --output-len 6 --warmup-steps 2 --async-scheduling true --max-num-batched-tokens 16
                 --enforce-eager)
  fi
}

start_engine() {  # NAME: build its engine in the background; it measures once WORK/NAME.go exists
  local name=$1 cmd
  engine_args "$name"
  if [ -n "$FAKE" ]; then
    cmd=($PY tools/gpu_check_fake.py run --make-model "$WORK/fake-model" $(crashes "$name" && echo --crash-at-batch 3) --)
  else
    cmd=(env TORCHINDUCTOR_COMPILE_THREADS=4 $PY -m engine.bench.latency)
  fi
  "${cmd[@]}" "${ENGINE_ARGS[@]}" --wait-for "$WORK/$name.go" --json "$WORK/$name.json" >"$WORK/$name.engine.log" 2>&1 &
  ENGINE_PID[$name]=$!
  echo "started the $name engine in the background (pid $!)"
}

run_engine() {  # NAME (inside a stage): build it now unless built ahead, let it measure, at most $LIMIT s
  local name=$1 rc
  [ -n "${ENGINE_PID[$name]:-}" ] || start_engine "$name"
  touch "$WORK/$name.go"
  wait_pid "${ENGINE_PID[$name]}" "$LIMIT"; rc=$?
  unset "ENGINE_PID[$name]"
  cat "$WORK/$name.engine.log"
  return $rc
}

# quiet_gpu [TIMED-ENGINE]: before a timed stage, wait (at most QUIET_WAIT_S, within the stage's
# limit) for every other live background engine to finish building (compiling, capturing, Triton
# autotuning all use the GPU); an engine has built once its JSON rows exist (status pending). What
# was found goes beside the stage's figures (WORK/STAGE.engines -> the stage JSON's "engines").
quiet_gpu() {
  local skip=${1:-} name state found=() t0=$(date +%s) wait_s=$QUIET_WAIT_S
  [ "$wait_s" -gt $(( LIMIT / 3 )) ] && wait_s=$(( LIMIT / 3 ))
  for name in "${!ENGINE_PID[@]}"; do
    [ "$name" = "$skip" ] && continue
    while kill -0 "${ENGINE_PID[$name]}" 2>/dev/null && [ ! -f "$WORK/$name.json" ] \
        && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do
      sleep 0.5
    done
    if [ -f "$WORK/$name.json" ] && kill -0 "${ENGINE_PID[$name]}" 2>/dev/null; then state=built-idle
    elif kill -0 "${ENGINE_PID[$name]}" 2>/dev/null; then state=still-building
    else state=exited; fi
    found+=("$name=$state")
  done
  echo "background engines before timing: ${found[*]:-none} (waited $(( $(date +%s) - t0 ))s)"
  echo "${found[*]:-none}" >"$WORK/$STAGE.engines"
}

stop_engines() {  # engines whose stage never ran (skipped, cut): end them with the script
  local name
  for name in "${!ENGINE_PID[@]}"; do
    kill -KILL "${ENGINE_PID[$name]}" 2>/dev/null
  done
}
trap stop_engines EXIT

# ---- the stages ---------------------------------------------------------------------------------
stage_env() {
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || { echo "wheel install failed"; return 1; }
    touch "$SITE/.kiln-gpu-check"
    export PYTHONPATH=$REPO:$SITE
  fi
  nvidia-smi -L 2>&1 | head -4
  echo "cores: $(nproc)"
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
        if m.name.endswith(".__main__"):  # (`python -m` entry points run their command when imported)
            continue
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

stage_kernel_cache() {
  if [ -n "$FAKE" ]; then
    timeout "$LIMIT" $PY tools/gpu_check_fake.py kernel-cache "$WORK/kernel-cache.json"; return
  fi
  timeout "$LIMIT" $PY -m compiler.kernels.cli --check --cache-dir "$KCACHE" --json "$WORK/kernel-cache.json"
}


GROUP_PYTEST_ARGS="-q -p no:cacheprovider"  # before each group's own arguments

stage_tests() {
  local pids=() names=() rc=0 r i entry engine entries=() left
  for engine in latency-8b:latency-8b quant-bench:quant-int4; do  # stage:engine, built while the tests run
    wanted "${engine%%:*}" && start_engine "${engine#*:}"
  done
  for entry in "${TEST_GROUPS[@]}"; do
    [ -n "$GROUPS_WANTED" ] && [[ ",$GROUPS_WANTED," != *",${entry%%|*},"* ]] && continue
    entries+=("$entry")
  done
  if [ -n "$FAKE" ]; then  # every group's arguments collected in one process (a group whose collection is
    # missing or differs collects its own); bounded by the deadline, not by the groups' limit
    left=$(( DEADLINE_S - ($(date +%s) - START) ))
    TORCHINDUCTOR_COMPILE_THREADS=2 KILN_NUM_GPU_BLOCKS=1024 timeout $(( left > 1 ? left : 1 )) \
      $PY tools/gpu_check_fake.py collect "$WORK/tests" -- "${entries[@]/|/|$GROUP_PYTEST_ARGS }"
  fi
  for entry in "${entries[@]}"; do
    run_group "${entry%%|*}" "${entry#*|}" &
    pids+=($!) names+=("${entry%%|*}")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; r=$?
    echo "tests-${names[$i]}: rc=$r  $(tail -n 1 "$WORK/tests-${names[$i]}.log")"
    $PY tools/gpu_summary.py group "$WORK" "${names[$i]}" "$r" "$(cat "$WORK/tests-${names[$i]}.secs")" >/dev/null
    [ $r -eq 124 ] && rc=124
    [ $r -ne 0 ] && [ $rc -eq 0 ] && rc=$r
  done
  return $rc
}

run_group() {  # NAME PYTEST-ARGS: one process of the tests stage (log, junit, seconds)
  local name=$1 args=$2 t0=$(date +%s) r runner="$PY -m pytest"
  if [ -n "$FAKE" ]; then  # the same arguments, collected for real; stand-in tests run (gpu_check_fake.py)
    runner="$PY tools/gpu_check_fake.py group $(crashes "tests:$name" && echo --crash)"
    runner+=" $(hangs "tests:$name" && echo --hang) $WORK/tests-$name --"
  fi
  # (eval: the quoted -k expressions.) One GPU, many processes: an engine that sizes its KV cache
  # from free memory would take 90% of the card (gpu_memory_utilization) from the others.
  # SIGINT at the limit, not SIGTERM: pytest stops and still writes the junit of the tests it
  # finished (SIGKILL 20 s later if it does not).
  eval "TORCHINDUCTOR_COMPILE_THREADS=2 KILN_NUM_GPU_BLOCKS=1024 timeout -s INT -k 20 $LIMIT $runner" \
    "$GROUP_PYTEST_ARGS $args --junitxml=$WORK/tests-$name.xml" >"$WORK/tests-$name.log" 2>&1; r=$?
  echo $(( $(date +%s) - t0 )) >"$WORK/tests-$name.secs"
  return $r
}

stage_kernel_bench() {  # DECODE PREFILL: one generation per process
  quiet_gpu
  if [ -n "$FAKE" ]; then
    timeout "$LIMIT" $PY tools/gpu_check_fake.py kernel-bench "$WORK/$STAGE.json" --decode-kernel "$1" \
      --prefill-kernel "$2" $(crashes "$STAGE" && echo --crash); return
  fi
  timeout "$LIMIT" $PY -m engine.bench.kernels --quick --cache-dir "$KCACHE" --decode-kernel "$1" \
    --prefill-kernel "$2" --json "$WORK/$STAGE.json"
}

stage_engine() {  # ENGINE [COMPARE-ARGS...]: time a latency engine; the stage JSON is the engine's rows, or
  # for a quantised engine (its name unlike the stage's) quant_compare's against latency-8b
  local engine=$1 r; shift
  quiet_gpu "$engine"
  run_engine "$engine"; r=$?
  if [ $# -gt 0 ]; then  # a quantised engine: against latency-8b's bf16 figures of this run
    $PY -m engine.bench.quant_compare --bf16 "$WORK/latency-8b.json" "$@" --json "$WORK/$STAGE.json"
  elif [ "$engine" != "$STAGE" ] && [ -f "$WORK/$engine.json" ]; then
    cp "$WORK/$engine.json" "$WORK/$STAGE.json"
  fi
  return $r
}

stage_stub() {  # a GPU benchmark command, or its stub on a fake device
  if [ -n "$FAKE" ]; then
    timeout "$LIMIT" $PY tools/gpu_check_fake.py bench "$STAGE" "$WORK/$STAGE.json" $(crashes "$STAGE" && echo --crash)
    return
  fi
  timeout "$LIMIT" "$@"
}

for STAGE in "${STAGES[@]}"; do
  LAST_STATUS=""
  case $STAGE in
    env)
      run_stage env stage_env
      if [ -n "$SIMULATE_S" ] || [ -n "$FAKE" ]; then :
      elif [ "$LAST_STATUS" != ok ]; then NO_GPU_REASON="env stage failed: engine imports or wheels (see env.log)"
      elif ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        NO_GPU_REASON="no CUDA device"
      fi ;;
    kernel-cache)
      run_stage kernel-cache stage_kernel_cache ;;
    tests)
      run_stage tests stage_tests ;;
    kernel-bench)
      run_stage kernel-bench stage_kernel_bench v1 mma ;;
    kernel-bench-v2)
      # only the newer generations whose GPU tests all passed (tests-kernels-v2), each in this process alone
      DEC=v1 PRE=mma
      for kv in $($PY tools/gpu_summary.py kernel-env "$WORK"/tests-kernels-*.xml 2>/dev/null); do
        echo "kernel generation verified: $kv"
        [ "$kv" = KILN_DECODE_KERNEL=v2 ] && DEC=v2
        [ "$kv" = KILN_PREFILL_KERNEL=wgmma ] && PRE=wgmma
      done
      if [ -n "$SIMULATE_S" ] || [ -n "$NO_GPU_REASON" ] || [ "$DEC$PRE" != v1mma ]; then
        run_stage kernel-bench-v2 stage_kernel_bench "$DEC" "$PRE"
      else
        echo "== kernel-bench-v2 skipped: decode v2 / wgmma prefill not verified by the tests stage"
        record kernel-bench-v2 skipped - 0 --reason "decode v2 / wgmma not verified (tests-kernels-v2: not all passed)"
      fi ;;
    latency-8b)
      run_stage latency-8b stage_engine latency-8b ;;
    quant-bench)
      run_stage quant-bench stage_engine quant-int4 --int4 "$WORK/quant-int4.json" ;;
    quant-tinygemm)
      run_stage quant-tinygemm stage_engine quant-int4-tinygemm --int4 "$WORK/quant-int4-tinygemm.json" ;;
    quant-fp8)
      run_stage quant-fp8 stage_engine quant-fp8-w8a8 --fp8 "$WORK/quant-fp8-w8a8.json" ;;
    w4a16-bench)
      run_stage w4a16-bench stage_stub $PY -m engine.bench.w4a16 --cache-dir "$KCACHE" \
        --json "$WORK/w4a16-bench.json" ;;
    moe-bench)
      run_stage moe-bench stage_stub $PY -m engine.bench.moe --json "$WORK/moe-bench.json" ;;
    swap-bench)  # (runs on the CPU as it is: the fake device runs it so)
      run_stage swap-bench $PY -m engine.bench.swap $([ -n "$FAKE" ] && echo --device cpu --blocks 1,6 --iters 2) \
        --json "$WORK/swap-bench.json" ;;
    latency-1b)
      run_stage latency-1b stage_engine latency-1b ;;
  esac
done

summarize
echo
cat "$OUT/summary.txt"
echo "(total $(( $(date +%s) - START ))s of DEADLINE_S=$DEADLINE_S; logs and JSON: $OUT/gpu_check.tar.gz)"
