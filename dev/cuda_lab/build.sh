#!/usr/bin/env bash
# Builds the kernel lab (dev/cuda_lab/lab.cu, lab_kernels.cu + src/kernels/*.cu) with nvcc for sm_90 into
# ${1:-build-lab}/odc_cuda_lab, against NCCL from $NCCL_HOME, else torch's nvidia-nccl wheel,
# else the CUDA toolkit. $NCCL_INCLUDE overrides the header folder (the wheel may ship none).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/build-lab}"
if [[ -n "${NCCL_HOME:-}" ]]; then
  nccl_inc="$NCCL_HOME/include"; nccl_lib="$NCCL_HOME/lib"
elif wheel="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)" \
    && [[ -n "$wheel" ]]; then
  nccl_inc="$wheel/include"; nccl_lib="$wheel/lib"
else
  cuda="$(dirname "$(dirname "$(command -v nvcc)")")"
  nccl_inc="$cuda/include"; nccl_lib="$cuda/lib64"
fi
nccl_inc="${NCCL_INCLUDE:-$nccl_inc}"
if [[ -e "$nccl_lib/libnccl.so" ]]; then nccl_link=-lnccl; else nccl_link=-l:libnccl.so.2; fi
echo "NCCL headers: $nccl_inc  library: $nccl_lib"
mkdir -p "$out"
nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -Xcompiler -Wall,-Wextra -Werror all-warnings \
  -I"$root/src" -I"$nccl_inc" \
  "$root/dev/cuda_lab/lab.cu" "$root/dev/cuda_lab/lab_kernels.cu" "$root/dev/cuda_lab/bulk_kernels.cu" "$root"/src/kernels/*.cu \
  -L"$nccl_lib" "$nccl_link" -Xlinker -rpath="$nccl_lib" -o "$out/odc_cuda_lab"
echo "built $out/odc_cuda_lab"
