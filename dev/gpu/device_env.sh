# Sourced by the NVSHMEM dev/gpu scripts (run from the repository root on the GPU machine): the
# library, tool and plugin built here and carried in .device/, NCCL's and NVSHMEM's libraries from
# the machine's Python packages, and NVLink multicast off (it can take the shared host down).
export PYTHONPATH=$PWD/python ODC_LIBRARY=$PWD/.device/libodc.so ODC_CLI=$PWD/.device/odc
export ODC_NVSHMEM_PLUGIN=$PWD/.device/libodc_nvshmem.so
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nccl_lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
nvshmem_dir=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/.device${nccl_lib:+:$nccl_lib}${nvshmem_dir:+:$nvshmem_dir/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
