#!/usr/bin/env bash
# Issue #41 item 2 on GPUs (twentieth round, docs/benchmarks-archive.md): the device progress test
# on two builds, snapshots in build/snap_new and build/snap_old (libodc.so, libodc_nvshmem.so,
# python/, tests/), run from the repository root; then the NVSHMEM suite's streamed tests on the new
# build. Logs under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvshmem_dir=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')
export LD_LIBRARY_PATH=$nvshmem_dir/lib:${LD_LIBRARY_PATH:-}
root=$PWD
use() { export ODC_LIBRARY=$root/build/snap_$1/libodc.so ODC_NVSHMEM_PLUGIN=$root/build/snap_$1/libodc_nvshmem.so; }
tests=$root/build/snap_new
export PYTHONPATH=$tests/python:$tests/tests/gpu:$tests/tests/python
nvidia-smi -L > $OUT/gpus.txt
use new
timeout 200 python3 -m pytest -x -rs -q $tests/tests/gpu/test_nvshmem_comm.py -k progress > $OUT/progress_new.log 2>&1; echo "progress new rc=$?" | tee -a $OUT/summary.txt
use old
timeout 100 python3 -m pytest -rs -q "$tests/tests/gpu/test_nvshmem_comm.py::test_nvshmem_pushes_progress_while_the_owners_stream_is_busy[nodes1]" > $OUT/progress_old.log 2>&1; echo "progress old rc=$?" | tee -a $OUT/summary.txt
use new
timeout 240 python3 -m pytest -rs -q $tests/tests/gpu/test_nvshmem_comm.py -k "rings_wrap or node_aggregated" > $OUT/suite_new.log 2>&1; echo "suite new rc=$?" | tee -a $OUT/summary.txt
for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done
