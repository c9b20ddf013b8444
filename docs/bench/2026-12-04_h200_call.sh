#!/usr/bin/env bash
# One device call on one H200 (performance.md AB), from the repo root with .carry/modules from
# the CMake build of a clean clone's `.ci/run` (the library's C++ as at 47cd44d): the package
# tree plus those modules on PYTHONPATH, then docs/bench/2026-12-04_h200_smoke.py from /tmp.
# Writes under $OUT: env.txt, smoke.json, smoke.log.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
R=$PWD
# NOTE: the git line names the device copy's own .git, which may be stale (performance.md AB).
(date -u; nvidia-smi -L; git -C "$R" log --oneline -1 2>/dev/null || true) > $OUT/env.txt
SITE=/tmp/jdg_site; rm -rf $SITE; mkdir -p $SITE
cp -r jax_distgemm $SITE/ && cp .carry/modules/_distgemm_*.so $SITE/jax_distgemm/ffi/
cd /tmp && PYTHONPATH=$SITE timeout ${SMOKE_TIMEOUT:-300} python3 $R/docs/bench/2026-12-04_h200_smoke.py \
  > $OUT/smoke.log 2>&1
echo "rc $?" >> $OUT/smoke.log
date -u >> $OUT/env.txt
