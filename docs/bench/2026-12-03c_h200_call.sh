#!/usr/bin/env bash
# One device call on one H200 (performance.md AA), from the repo root with
# .carry/virtual_group_check from a CMake build of the working tree (the tool's main streams made
# once in main instead of a function-static vector; the library's C++ as at 47cd44d):
#   1. tools/gpu_check.sh --virtual-tp-only (the tool's default: one group per run);
#   2. docs/bench/2026-12-03b_h200_group_reuse.sh: whole TP=8 runs interleaved round by round,
#      one group per run at 16 and 32 hardware queues and a group per case at 32, until
#      REUSE_TIMEOUT (Z3's statistic, with more runs).
# Writes under $OUT: env.txt, virtual_tp.txt, reuse/{summary,failures}.txt, reuse_stdout.txt.
set -u
R=$PWD
(date -u; nvidia-smi -L; echo "tree of ${TREE:-?}") > $OUT/env.txt
OUT=/tmp/v timeout ${VTP_ALL_TIMEOUT:-150} tools/gpu_check.sh --virtual-tp-only > $OUT/virtual_tp.txt 2>&1
echo "rc $?" >> $OUT/virtual_tp.txt
date -u >> $OUT/env.txt
timeout ${REUSE_TIMEOUT:-370} docs/bench/2026-12-03b_h200_group_reuse.sh $R/.carry/virtual_group_check \
  $OUT/reuse 1000 0 > $OUT/reuse_stdout.txt 2>&1
echo "rc $?" >> $OUT/reuse_stdout.txt
date -u >> $OUT/env.txt
