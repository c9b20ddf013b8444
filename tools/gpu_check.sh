#!/usr/bin/env bash
# The GPU check: install, the GPU tests, the virtual-rank check, the multi-process check and the
# benchmark suite, each logged to $OUT (default ./gpu_out); a summary line per step, a verdict.
#
#   tools/gpu_check.sh [--tests-only | --virtual-only | --mp-only | --bench-only] [bench args]
#
# The package: a build carried in .carry/pkg (jax_distgemm/ with its compiled modules), else
# `pip install .` (needs nvcc and the build requirements).  The virtual-rank check needs
# .carry/virtual_group_check (CMake with -DJAX_DISTGEMM_BUILD_TESTS=ON); one GPU is enough for
# it.  Env: TEST_TIMEOUT, VTP_TIMEOUT (per virtual run), SEQ_RUNS (back-to-back TP=8 sequences,
# default 20), BENCH_TIMEOUT.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
MODE=${1:-all}
[[ $MODE == --* ]] && shift || MODE=all
# PYTHONSAFEPATH: the installed package, never the source tree in the working directory.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
FAILED=0
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
step() {  # name timeout command...: runs it, logs its tail's verdict
  local name=$1 limit=$2 rc
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  log "$name: exit $rc; $(grep -E 'passed|failed|ALL OK|FAILED|WATCHDOG' "$OUT/$name.log" | tail -1)"
  [[ $rc -ne 0 ]] && FAILED=1
  return $rc
}

install() {
  if [[ -d .carry/pkg/jax_distgemm ]]; then
    export PYTHONPATH=$ROOT/.carry/pkg${PYTHONPATH:+:$PYTHONPATH}
  else
    $PY -m pip install -q . > "$OUT/install.log" 2>&1 || { log "install: FAILED"; exit 1; }
  fi
  log "package: $(cd /tmp && $PY -c 'import jax_distgemm as j; print(j.__file__, "cuda:", j.ffi.has_cuda())')"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 | sed 's/^/GPU: /' | tee -a "$OUT/summary.txt"
}

gpu_tests() {
  JAX_DISTGEMM_REQUIRE_GPU=1 step gpu_tests "${TEST_TIMEOUT:-400}" $PY -m pytest -q -p no:cacheprovider \
    tests/cuda_test.py tests/cuda_fp8_test.py tests/cuda_tuning_test.py tests/nnx_test.py \
    -k "Cuda or cuda"
}

virtual() {
  local bin=$ROOT/.carry/virtual_group_check
  [[ -x $bin ]] || { log "virtual: NOT RUN (no .carry/virtual_group_check)"; FAILED=1; return; }
  local t=${VTP_TIMEOUT:-90} odd="--m 1680 --n 1680 --k 1680"
  # Every schedule and data path, per call, at TP 2-8; batches and the other types at TP=4.
  for args in "--tp 2" "--tp 4" "--tp 8" "--tp 3 $odd" "--tp 5 $odd" "--tp 6 $odd" "--tp 7 $odd" \
              "--tp 4 --batch 2" "--tp 4 --f16 1" "--tp 4 --out-f32 1" "--tp 4 --f16 1 --out-f32 1"; do
    step "virtual_${args// /_}" "$t" "$bin" $args
  done
  # fp8, per tensor and in blocks: every schedule and path at TP 2-8 (a shard of 256 in every
  # split dim: whole 128-blocks), fp32 out once, and the control.
  local tp scaling
  for tp in 2 3 4 5 6 7 8; do
    for scaling in tensor block; do
      step "virtual_fp8_${scaling}_tp$tp" "$t" "$bin" --tp $tp --fp8 $scaling \
        --m $((256 * tp)) --n $((256 * tp)) --k $((256 * tp))
    done
  done
  step virtual_fp8_block_tp4_f32 "$t" "$bin" --tp 4 --fp8 block --out-f32 1
  timeout "$t" "$bin" --tp 4 --fp8 block --control 1 > "$OUT/virtual_fp8_control.log" 2>&1
  log "virtual_fp8_control: $(grep -c 'control OK' "$OUT/virtual_fp8_control.log") cases caught, $(grep -c 'not caught' "$OUT/virtual_fp8_control.log") not"
  grep -q 'not caught' "$OUT/virtual_fp8_control.log" && FAILED=1
  # Every case back to back, no synchronization between calls.
  for args in "--tp 2" "--tp 3 $odd" "--tp 4"; do
    step "virtual_seq_${args// /_}" "$t" "$bin" --sequence 1 $args
  done
  local ok=0 i
  for i in $(seq 1 "${SEQ_RUNS:-20}"); do
    timeout "$t" "$bin" --tp 8 --sequence 1 --calls 8 --deadline-s 80 > "$OUT/virtual_seq8_run.log" 2>&1 \
      && ok=$((ok + 1)) || cat "$OUT/virtual_seq8_run.log" >> "$OUT/virtual_seq8_failures.log"
  done
  log "virtual_seq_tp8 (8 rounds, back to back): $ok of ${SEQ_RUNS:-20} runs passed"
  [[ $ok -eq ${SEQ_RUNS:-20} ]] || FAILED=1
  # The check can fail: each rank compared with its neighbour's expected output.
  timeout "$t" "$bin" --tp 4 --control 1 > "$OUT/virtual_control.log" 2>&1
  log "virtual_control: $(grep -c 'control OK' "$OUT/virtual_control.log") cases caught, $(grep -c 'not caught' "$OUT/virtual_control.log") not"
  grep -q 'not caught' "$OUT/virtual_control.log" && FAILED=1
  # Faults: a dead peer; epochs past 2^31 and near 2^32; a late peer after reset(); copies
  # into the gathered result held past the call.  Every rank must return, ranks 1..TP-1 with
  # the timeout, and nothing may pass early or write after the return.
  for args in "--tp 2" "--tp 8" "--tp 4 --start-epoch 2147483653" "--tp 4 --start-epoch 4294967290" \
              "--tp 4 --late-peer 1" "--tp 2 --hold-copies 1"; do
    step "virtual_fault_${args// /_}" "$t" "$bin" --fault 1 --timeout-ms 500 $args
  done
}

mp() {
  [[ $(nvidia-smi -L | wc -l) -ge 2 ]] || { log "multi-process: NOT RUN (fewer than 2 GPUs)"; return; }
  step mp 300 $PY tests/multiprocess_launcher.py --platform gpu -n 2 --timeout 240
}

bench() {
  step bench "${BENCH_TIMEOUT:-560}" $PY -m jax_distgemm.bench --suite --local-gemm \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@"
}

install
case $MODE in
  --tests-only) gpu_tests ;;
  --virtual-only) virtual ;;
  --mp-only) mp ;;
  --bench-only) bench "$@" ;;
  *) gpu_tests; virtual; mp; bench "$@" ;;
esac
log "verdict: $([[ $FAILED -eq 0 ]] && echo PASS || echo FAIL)"
exit $FAILED
