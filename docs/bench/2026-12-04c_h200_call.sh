#!/usr/bin/env bash
# Third device call on one H200 (performance.md AB3), from the repo root with .carry/modules from
# the CMake build of fc0ddc7's clean-clone `.ci/run` (the C++ of this session): the package tree
# plus those modules on PYTHONPATH, then from a copy of tests/ in /tmp
#   1. tests/cuda_tuning_test.py (save_tuning / load_tuning through the CUDA module, after
#      156757f's changes to their reading and writing);
#   2. python -m jax_distgemm.bench at TP=1 on the one GPU, two shapes, twice with one
#      --tuning-file: the second run tunes the other shape and must keep the first's record
#      (the merge); then a run whose --json directory does not exist (a usage error, exit 2).
# Writes under $OUT: env.txt, tuning_test.log, bench{1,2,3}.log, bench{1,2}.json, tuning.json.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
R=$PWD
(date -u; nvidia-smi -L) > $OUT/env.txt
SITE=/tmp/jdg_site; rm -rf $SITE; mkdir -p $SITE
cp -r jax_distgemm $SITE/ && cp .carry/modules/_distgemm_*.so $SITE/jax_distgemm/ffi/
rm -rf /tmp/jdg_run && mkdir -p /tmp/jdg_run && cp -r tests /tmp/jdg_run/ && cd /tmp/jdg_run
export PYTHONPATH=$SITE PYTHONSAFEPATH=1
JAX_DISTGEMM_REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -rs tests/cuda_tuning_test.py \
  > $OUT/tuning_test.log 2>&1; echo "rc $?" >> $OUT/tuning_test.log
B="python3 -m jax_distgemm.bench --tp 1 --schedule AG-RotA --k 4096 --n 4096 --repeats 3
   --no-windowed-einsum --no-gpu-monitor --tuning-file $OUT/tuning.json"
timeout 150 $B --m 4096 --json $OUT/bench1.json > $OUT/bench1.log 2>&1; echo "rc $?" >> $OUT/bench1.log
timeout 150 $B --m 8192 --json $OUT/bench2.json > $OUT/bench2.log 2>&1; echo "rc $?" >> $OUT/bench2.log
timeout 60 $B --m 4096 --json /nonexistent/dir/b.json > $OUT/bench3.log 2>&1; echo "rc $?" >> $OUT/bench3.log
date -u >> $OUT/env.txt
