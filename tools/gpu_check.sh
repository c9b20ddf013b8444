#!/usr/bin/env bash
# One command for the GPU machine (nvidia-h200-x2): install the package, run the GPU tests twice
# (the verdict must repeat), then the benchmark suite.  Logs and JSON land in $OUT (or ./gpu_out).
#
#   tools/gpu_check.sh [--tests-only | --bench-only] [bench args...]   (default bench: --suite)
#
# Env: GPU_TEST_RUNS (default 2), TEST_TIMEOUT / BENCH_TIMEOUT (seconds), GPU_TEST_ARGS (more
# test files/filters; default: the Flax layer tests through CUDA, "tests/nnx_test.py -k Cuda").
# Installs, in order of preference: a cp312 wheel carried in .carry/ (pip wheel . on the dev
# machine), prebuilt modules in .carry/modules/ (_distgemm_*.so from a CMake build there), else
# builds from source here (needs CUTLASS headers: pip's nvidia-cutlass or .carry/cutlass_include).
# Fails if the GPU tests skip on a machine that has two Hopper GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
MODE=${1:-all}
[[ "$MODE" == --* ]] && shift || MODE=all

# Never use NVLink multicast on these shared machines.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

# -- Machine -------------------------------------------------------------------------------------
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } \
  > "$OUT/machine.txt" 2>&1 || true
log "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tr '\n' ',' )"
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" \
  2>&1 | tee -a "$OUT/summary.txt"

# -- Install -------------------------------------------------------------------------------------
SITE=/tmp/jax_distgemm_site
rm -rf "$SITE"; mkdir -p "$SITE"
WHEEL=$(ls .carry/jax_distgemm-*.whl 2>/dev/null | head -1 || true)
if [[ -n "$WHEEL" ]]; then
  log "installing $WHEEL"
  $PY -m pip install -q --no-deps --no-index --target "$SITE" "$WHEEL"
elif ls .carry/modules/_distgemm_cuda*.so >/dev/null 2>&1; then
  log "using prebuilt modules from .carry/modules"
  cp -r jax_distgemm "$SITE/"
  cp .carry/modules/_distgemm_*.so "$SITE/jax_distgemm/ffi/"
else
  log "no carried wheel: building from source"
  CUTLASS_ARG=""
  [[ -d .carry/cutlass_include ]] && CUTLASS_ARG="-DCUTLASS_INCLUDE_DIR=$ROOT/.carry/cutlass_include"
  cmake -S . -B /tmp/jdg_build -G Ninja -DPython_EXECUTABLE="$(command -v $PY)" \
    -DJAX_DISTGEMM_CUDA=ON -DCMAKE_BUILD_TYPE=Release $CUTLASS_ARG > "$OUT/build.log" 2>&1
  ninja -C /tmp/jdg_build >> "$OUT/build.log" 2>&1
  cp -r jax_distgemm "$SITE/"
  cp /tmp/jdg_build/_distgemm_*.so "$SITE/jax_distgemm/ffi/"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# Run from a copy of tests/ so that the installed package, not the source tree, is imported.
RUN=/tmp/jax_distgemm_run
rm -rf "$RUN"; mkdir -p "$RUN"; cp -r tests examples "$RUN/"
cd "$RUN"
$PY -c "import jax_distgemm, jax_distgemm.ffi as f; print('jax_distgemm from', jax_distgemm.__file__, 'cuda:', f.has_cuda(), f.cuda_import_error)" \
  2>&1 | tee -a "$OUT/summary.txt"

status=0
# -- GPU tests, twice ------------------------------------------------------------------------------
if [[ "$MODE" != --bench-only ]]; then
  for run in $(seq 1 "${GPU_TEST_RUNS:-2}"); do
    set +e
    JAX_DISTGEMM_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-400}" $PY -m pytest -q -rs tests/cuda_test.py ${GPU_TEST_ARGS-tests/nnx_test.py -k Cuda} \
      > "$OUT/gpu_tests_run$run.log" 2>&1
    rc=$?
    set -e
    log "GPU tests run $run: exit $rc; $(tail -1 "$OUT/gpu_tests_run$run.log")"
    if grep -q "skipped" "$OUT/gpu_tests_run$run.log"; then log "FAIL: GPU tests skipped"; rc=1; fi
    [[ $rc -ne 0 ]] && status=1
  done
fi

# -- Benchmark -----------------------------------------------------------------------------------
if [[ "$MODE" != --tests-only ]]; then
  set +e
  [[ $# -eq 0 ]] && set -- --suite --local-gemm
  timeout "${BENCH_TIMEOUT:-500}" $PY -m jax_distgemm.bench --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" \
    > "$OUT/bench.log" 2>&1
  rc=$?
  set -e
  log "bench: exit $rc"
  tail -40 "$OUT/bench.log"
  [[ $rc -ne 0 ]] && status=1
fi
log "verdict: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
exit $status
