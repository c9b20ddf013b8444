#!/usr/bin/env bash
# The virtual check's new --sequence mode (every case back to back, no synchronization between
# calls) against the executor before and after aea1550 (the ReduceScatter rings' own flag row,
# RingFlags): the same tool source built against HEAD (.carry/virtual_group_check) and against
# HEAD with aea1550's executor.cc / peer_state.h changes reverted (.carry/virtual_group_check_prefix).
# Interleaved runs, TP=8 then TP=4; then the dead-peer step at TP=8 again, with its logs.
# (The stalled run of the first call: `..._prefix_tp8_stall.log`; summary `..._sequence_ab_run1.txt`.)
# Usage: docs/bench/2026-12-05_h200_sequence_ab.sh OUTDIR ROUNDS8 ROUNDS4 FAULT_RUNS
# Writes OUTDIR/summary.txt (a line per run), OUTDIR/failures.txt, OUTDIR/logs/.
set -u
out=$1 rounds8=${2:-8} rounds4=${3:-4} fault_runs=${4:-3}
mkdir -p "$out/logs"
: > "$out/summary.txt"
export CUDA_DEVICE_MAX_CONNECTIONS=32
run() {  # name, binary, args...
  local name=$1 bin=$2; shift 2
  local start rc secs log=$out/logs/$name.log
  start=$(date +%s.%N)
  timeout 90 ".carry/$bin" "$@" > "$log" 2>&1
  rc=$?
  secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  echo "$name $bin rc $rc secs $secs: $(grep -E '^sequence|WATCHDOG|fault FAIL' "$log" | head -2 | cut -c1-200 | tr '\n' ' ')" >> "$out/summary.txt"
  if [[ $rc -ne 0 ]]; then
    { echo "--- $name $bin"; grep -E 'FAIL|call -?[0-9]+ rank|WATCHDOG' "$log" | cut -c1-300; } >> "$out/failures.txt"
  fi
}
for tp_rounds in "8 $rounds8" "4 $rounds4"; do
  read -r tp rounds <<< "$tp_rounds"
  for ((r = 1; r <= rounds; ++r)); do
    run "seq_tp${tp}_r${r}_old" virtual_group_check_prefix --tp "$tp" --sequence 1 --calls 4
    run "seq_tp${tp}_r${r}_new" virtual_group_check --tp "$tp" --sequence 1 --calls 4
  done
done
# The dead-peer step at TP=8 (one of six cases failed once at 02:55 UTC), HEAD against HEAD with
# the fused grid's join waiting twice the timeout (.carry/virtual_group_check_joinfix, if carried).
for ((r = 1; r <= fault_runs; ++r)); do
  run "fault_tp8_r${r}_head" virtual_group_check --tp 8 --fault 1 --timeout-ms 500 --verbose 1
  [[ -x .carry/virtual_group_check_joinfix ]] &&
    run "fault_tp8_r${r}_joinfix" virtual_group_check_joinfix --tp 8 --fault 1 --timeout-ms 500 --verbose 1
done
