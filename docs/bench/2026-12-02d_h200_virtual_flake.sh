#!/usr/bin/env bash
# Y3's flake of the virtual-rank check at TP=8: which setting makes it come and go?
# Interleaved whole TP=8 runs of tools/virtual_group_check under four settings:
#   base   the tool's own (CUDA_DEVICE_MAX_CONNECTIONS=32, lazy module loading)
#   conn8  CUDA_DEVICE_MAX_CONNECTIONS=8 (CUDA's default: 16 streams on 8 hardware queues)
#   conn4  CUDA_DEVICE_MAX_CONNECTIONS=4
#   eager  CUDA_MODULE_LOADING=EAGER (every kernel loaded at context creation)
# Usage: docs/bench/2026-12-02d_h200_virtual_flake.sh BIN OUTDIR ROUNDS [CONN_ROUNDS]
# (base and eager run ROUNDS times, conn8 and conn4 in the first CONN_ROUNDS rounds only)
# Every run a fresh group per case, the tool's default when Z2 ran it (--group-per-case 1 now).
set -u
bin=$1 out=$2 rounds=${3:-10} conn_rounds=${4:-5}
mkdir -p "$out"
summary=$out/virtual_flake_summary.txt
: > "$summary"
for ((r = 1; r <= rounds; ++r)); do
  for cond in base conn8 conn4 eager; do
    [[ $cond == conn* && $r -gt $conn_rounds ]] && continue
    env=()
    case $cond in
      conn8) env=(CUDA_DEVICE_MAX_CONNECTIONS=8) ;;
      conn4) env=(CUDA_DEVICE_MAX_CONNECTIONS=4) ;;
      eager) env=(CUDA_MODULE_LOADING=EAGER) ;;
    esac
    log=$out/run.log
    start=$(date +%s.%N)
    env "${env[@]}" timeout 60 "$bin" --tp 8 --group-per-case 1 > "$log" 2>&1
    rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
    ok=$(grep -c ' OK ' "$log"); fail=$(grep -c ' FAIL ' "$log")
    echo "round $r $cond rc $rc ok $ok fail $fail secs $secs" >> "$summary"
    if [[ $rc -ne 0 ]]; then  # keep what each failing run said: failed cases, slow calls
      { echo "--- round $r $cond"; grep -E ' FAIL |call [0-9]+ rank|WATCHDOG' "$log" | cut -c1-260; } \
        >> "$out/virtual_flake_failures.txt"
    fi
  done
done
for cond in base conn8 conn4 eager; do
  echo "$cond: $(grep -c " $cond rc 0 " "$summary") clean of $(grep -c " $cond rc " "$summary") runs," \
       "$(awk -v c=$cond '$3 == c {s += $9} END {print s}' "$summary") failed cases" >> "$summary"
done
rm -f "$out/run.log"
tail -4 "$summary"
