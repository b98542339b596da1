#!/usr/bin/env bash
# Issue #41 item 2 (twentieth round, docs/benchmarks-archive.md): odc.train over NVSHMEM (pretended
# nodes, flat) with the builds in build/snap_old and build/snap_new, alternated, on the same GPUs.
set -u
root=$PWD
rounds=${ROUNDS:-2}
for round in $(seq 1 $rounds); do
  for v in old new; do
    OUT=$OUT/train_${v}_$round NVTRAIN_ARMS=nvshmem-flat NVTRAIN_STEPS=${STEPS:-5} \
      timeout 200 bash dev/gpu/run.sh nvshmem-train --snapshot $root/build/snap_$v > /dev/null 2>&1
    echo "round $round $v rc=$?" >> $OUT/summary.txt
  done
done
cat $OUT/summary.txt
for f in $OUT/train_*/nvshmem_train/nvshmem_train.txt; do echo "== $f"; cat $f; done
