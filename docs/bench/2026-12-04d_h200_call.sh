#!/usr/bin/env bash
# Fourth device call on one H200 (performance.md AB4): the package tree with fc0ddc7's modules
# (the C++ is unchanged since), then docs/bench/2026-12-04d_h200_fp16.py from /tmp.
# Writes under $OUT: env.txt, fp16.json, fp16.log.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
R=$PWD
(date -u; nvidia-smi -L) > $OUT/env.txt
SITE=/tmp/jdg_site; rm -rf $SITE; mkdir -p $SITE
cp -r jax_distgemm $SITE/ && cp .carry/modules/_distgemm_*.so $SITE/jax_distgemm/ffi/
cd /tmp && PYTHONPATH=$SITE timeout 240 python3 $R/docs/bench/2026-12-04d_h200_fp16.py > $OUT/fp16.log 2>&1
echo "rc $?" >> $OUT/fp16.log
date -u >> $OUT/env.txt
