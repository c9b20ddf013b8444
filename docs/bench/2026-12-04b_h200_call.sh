#!/usr/bin/env bash
# Second device call on one H200 (performance.md AB2), from the repo root with .carry/modules
# from the CMake build of a clean clone's `.ci/run` at TREE (the C++ with the cross-process call
# signature, 60436bf): the package tree plus those modules on PYTHONPATH, then from /tmp
#   1. docs/bench/2026-12-04_h200_smoke.py (the nnx block on an Explicit mesh; a vmap-bound axis);
#   2. docs/bench/2026-12-04b_h200_vmap.py (the FFI vmap rule, batched x and mapped 2-D w);
#   3. examples/launch_multiprocess.py --platform gpu -n 1 (the new initialize_multiprocess on
#      CUDA: one process, one GPU, so TP=1, not a test of groups across processes).
# Writes under $OUT: env.txt, smoke.json/.log, vmap.json/.log, mp1.log.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
R=$PWD
(date -u; nvidia-smi -L; echo "tree of ${TREE:-?}") > $OUT/env.txt
SITE=/tmp/jdg_site; rm -rf $SITE; mkdir -p $SITE
cp -r jax_distgemm $SITE/ && cp .carry/modules/_distgemm_*.so $SITE/jax_distgemm/ffi/
cd /tmp
PYTHONPATH=$SITE timeout 240 python3 $R/docs/bench/2026-12-04_h200_smoke.py > $OUT/smoke.log 2>&1
echo "rc $?" >> $OUT/smoke.log
PYTHONPATH=$SITE timeout 240 python3 $R/docs/bench/2026-12-04b_h200_vmap.py > $OUT/vmap.log 2>&1
echo "rc $?" >> $OUT/vmap.log
cp -r $R/examples /tmp/jdg_examples
PYTHONPATH=$SITE PYTHONSAFEPATH=1 timeout 300 python3 /tmp/jdg_examples/launch_multiprocess.py \
  --platform gpu -n 1 --timeout 240 > $OUT/mp1.log 2>&1
echo "rc $?" >> $OUT/mp1.log
date -u >> $OUT/env.txt
