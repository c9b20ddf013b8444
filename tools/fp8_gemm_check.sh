#!/usr/bin/env bash
# The fp8 stage GEMMs on one Hopper GPU (nvidia-h100-x1): the check program's numerics and
# timing at the fp8 issue's stage shapes, then in one Python process the baselines at the same
# shapes (torch._scaled_mm per-tensor with fp32 and with fast accumulation, its error against
# float64, bf16 torch.matmul, JAX's fp8 dot_general), then a summary of the issue's targets.
# Logs and JSON lines land in $OUT (or ./fp8_out).  Needs no network and nothing installed by
# the project: the check binary is carried in, Python needs torch and jax (either may be
# missing: its lines say so).  About 2-3 minutes; every step has a timeout.
#
#   tools/fp8_gemm_check.sh [path/to/fp8_gemm_check]
#
# The binary: $1, else $FP8_CHECK_BIN, else .carry/fp8_gemm_check, else build/fp8/fp8_gemm_check
# (cmake -S . -B build/fp8 -G Ninja -DJAX_DISTGEMM_BUILD_TESTS=ON && ninja -C build/fp8 -j1
# fp8_gemm_check on the dev machine).  Env: FP8_SHAPES (MxKxN,...), FP8_REPEATS (30),
# CHECK_TIMEOUT (150 s), BASELINE_TIMEOUT (200 s), FP8_CHECK_ARGS (more check arguments).
set -u -o pipefail
CALLER_PWD=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/fp8_out}
case "$OUT" in /*) ;; *) OUT=$CALLER_PWD/$OUT ;; esac
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SHAPES=${FP8_SHAPES:-4096x8192x14336,2048x8192x4096,6144x6144x12288,4096x4096x28672,8192x16384x8192,8192x16384x53248}
REPEATS=${FP8_REPEATS:-30}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=1

log() { echo "[fp8_gemm_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
# Kernel lines of a check log that passed / failed (a failed transpose self-check counts too).
oks() { grep -cE '^(tensor|block) .* OK ' "$1"; }
fails() { grep -cE '^(tensor|block) .* FAIL|self-check: FAIL' "$1"; }
: > "$OUT/summary.txt"

BIN=${1:-${FP8_CHECK_BIN:-}}
if [[ -z "$BIN" ]]; then
  for cand in "$ROOT/.carry/fp8_gemm_check" "$ROOT/build/fp8/fp8_gemm_check"; do
    [[ -x "$cand" ]] && { BIN=$cand; break; }
  done
fi
case "${BIN:-}" in ""|/*) ;; *) BIN=$CALLER_PWD/$BIN ;; esac

timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv \
  > "$OUT/nvidia_smi.txt" 2>&1
log "GPU: $(tail -n +2 "$OUT/nvidia_smi.txt" | head -1)"

status=0
# 1. The check program: every compiled kernel at the stage shapes (numerics, then timing).
if [[ -n "${BIN:-}" && -x "$BIN" ]]; then
  # shellcheck disable=SC2086
  timeout -k 10 "${CHECK_TIMEOUT:-150}" "$BIN" --shapes "$SHAPES" --repeats "$REPEATS" \
    --jsonl "$OUT/check.jsonl" ${FP8_CHECK_ARGS:-} > "$OUT/check.log" 2>&1
  rc=$?
  log "check (stage shapes): exit $rc; $(oks "$OUT/check.log") OK, $(fails "$OUT/check.log") FAIL; $(tail -1 "$OUT/check.log")"
  [[ $rc -ne 0 ]] && status=1
  # Batched, padded leading dims, D and C inside wider buffers, ragged M and partial tiles
  # (numerics only).
  timeout -k 10 60 "$BIN" --shapes 1000x2048x1536,264x4224x400,129x720x272 --batch 2 --pad 64 \
    --check-only --jsonl "$OUT/check_layout.jsonl" > "$OUT/check_layout.log" 2>&1
  rc=$?
  log "check (batch 2, padded, sub-block D): exit $rc; $(oks "$OUT/check_layout.log") OK, $(fails "$OUT/check_layout.log") FAIL"
  [[ $rc -ne 0 ]] && status=1
  # Tile orders: both rasters, bands of 2 and 8, tile counts that are not whole bands (the
  # banded side padded, the other not: DropBandPadding); every output compared.
  : > "$OUT/check_order.log"
  for raster in 1 2; do
    for band in 2 8; do
      timeout -k 10 60 "$BIN" --shapes 2048x384x1000,1000x384x2000 --raster $raster \
        --swizzle $band --sample 2048 --out bf16 --check-only >> "$OUT/check_order.log" 2>&1 \
        || status=1
    done
  done
  log "check (tile orders): $(oks "$OUT/check_order.log") OK, $(fails "$OUT/check_order.log") FAIL"
  # Programmatic dependent launch (the executor's default) at two shapes, per-tensor bf16.
  timeout -k 10 60 "$BIN" --shapes 4096x8192x14336,2048x8192x4096 --scaling tensor --types e4m3 \
    --out bf16 --pdl 1 --repeats "$REPEATS" --jsonl "$OUT/check_pdl.jsonl" \
    > "$OUT/check_pdl.log" 2>&1
  log "check (PDL on): exit $?"
else
  log "check: NOT RUN (no binary: pass its path, set FP8_CHECK_BIN or carry .carry/fp8_gemm_check)"
  status=1
fi

# 2. Baselines in one Python process (torch first, then JAX; each reports its own failures).
timeout -k 10 "${BASELINE_TIMEOUT:-200}" "$PY" "$ROOT/tools/fp8_gemm_baselines.py" bench \
  --shapes "$SHAPES" --repeats "$REPEATS" --jsonl "$OUT/baselines.jsonl" \
  > "$OUT/baselines.log" 2>&1
rc=$?
log "baselines (torch._scaled_mm, torch bf16, jax fp8 dot): exit $rc; $(grep -c '"tflops"' "$OUT/baselines.log") timed"
[[ $rc -ne 0 ]] && status=1

# 3. Summary: TFLOP/s and errors side by side, the issue's targets MET / MISS.
timeout -k 10 60 "$PY" "$ROOT/tools/fp8_gemm_baselines.py" summary \
  --check "$OUT/check.jsonl" "$OUT/check_layout.jsonl" "$OUT/check_pdl.jsonl" \
  --baselines "$OUT/baselines.jsonl" --out "$OUT/targets.txt" \
  > "$OUT/summary_table.log" 2>&1
cat "$OUT/summary_table.log" | tee -a "$OUT/summary.txt"
log "verdict (the check program's numerics and the runs completing; targets above): $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
exit $status
