#!/usr/bin/env bash
# One device call on one H200 (performance.md Z), from the repo root with
# .carry/ (modules + virtual_group_check from a CMake build of the working tree):
#   1. tools/gpu_check.sh --virtual-tp-only (TP 2-8, control, dead peer);
#   2. docs/bench/2026-12-02d_h200_virtual_flake.sh: interleaved TP=8 runs under four settings;
#   3. the TP=1 smokes: the gathered operand (2026-12-02c) and empty outputs (2026-12-03).
# Writes under $OUT: env.txt, virtual_tp.txt, flake/, flake_stdout.txt, smoke.log, empty.log
# and the smokes' JSON.
set -u
R=$PWD S=/tmp/site
mkdir -p $S && cp -r jax_distgemm $S/ && cp .carry/modules/_distgemm_*.so $S/jax_distgemm/ffi/
export PYTHONPATH=$S NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
(date -u; nvidia-smi -L; git -C $R log -1 --format=%h 2>/dev/null) > $OUT/env.txt
OUT=/tmp/v timeout ${VTP_ALL_TIMEOUT:-140} tools/gpu_check.sh --virtual-tp-only > $OUT/virtual_tp.txt 2>&1
echo "rc $?" >> $OUT/virtual_tp.txt
timeout ${FLAKE_TIMEOUT:-280} docs/bench/2026-12-02d_h200_virtual_flake.sh $R/.carry/virtual_group_check \
  $OUT/flake ${FLAKE_ROUNDS:-15} ${FLAKE_CONN_ROUNDS:-5} > $OUT/flake_stdout.txt 2>&1
echo "rc $?" >> $OUT/flake_stdout.txt
cd /tmp
timeout 80 python $R/docs/bench/2026-12-02c_h200_gathered.py > $OUT/smoke.log 2>&1; echo "rc $?" >> $OUT/smoke.log
timeout 60 python $R/docs/bench/2026-12-03_h200_empty.py > $OUT/empty.log 2>&1; echo "rc $?" >> $OUT/empty.log
date -u >> $OUT/env.txt
