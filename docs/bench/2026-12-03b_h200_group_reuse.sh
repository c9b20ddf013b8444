#!/usr/bin/env bash
# Z2's rare residual flake at 32 hardware queues: does the virtual check's stream churn cause it?
# With --group-per-case 1 every case makes a fresh group, and groups live for the process, so
# a run leaves 8 more copy streams alive per case at TP=8 while each case's 16 streams are
# created anew.  With --group-per-case 0 the run has one group (reset between cases) and 16
# streams in all.
# (Run in Z3 with the tool's old default, 1; both modes are named explicitly now.)
# Interleaved whole TP=8 runs (26 cases):
#   old16 / new16  CUDA_DEVICE_MAX_CONNECTIONS=16 (exactly the 16 streams a case needs), old / new
#   old32 / new32  the tool's 32 queues, old / new
# (old16 only in the first OLD16_ROUNDS rounds: a stalled run costs up to 30 s).
# Usage: docs/bench/2026-12-03b_h200_group_reuse.sh BIN OUTDIR ROUNDS [OLD16_ROUNDS]
# Writes OUTDIR/summary.txt (a line per run) and OUTDIR/failures.txt.
set -u
bin=$1 out=$2 rounds=${3:-20} old16_rounds=${4:-5}
mkdir -p "$out"
: > "$out/summary.txt"
for ((r = 1; r <= rounds; ++r)); do
  for cond in old16 new16 new32 old32; do
    [[ $cond == old16 && $r -gt $old16_rounds ]] && continue
    args=(--tp 8 --group-per-case 1); [[ $cond == new* ]] && args=(--tp 8 --group-per-case 0)
    start=$(date +%s.%N)
    CUDA_DEVICE_MAX_CONNECTIONS=${cond: -2} timeout 60 "$bin" "${args[@]}" > "$out/run.log" 2>&1
    rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
    echo "round $r $cond rc $rc ok $(grep -c ' OK ' "$out/run.log") fail $(grep -c ' FAIL ' "$out/run.log") secs $secs" >> "$out/summary.txt"
    if [[ $rc -ne 0 ]]; then
      { echo "--- round $r $cond"; grep -E ' FAIL |call [0-9]+ rank 0|WATCHDOG' "$out/run.log" | cut -c1-260; } \
        >> "$out/failures.txt"
    fi
  done
done
